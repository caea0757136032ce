"""A resumed run's logged history: rows past the restored step are dropped before it goes on.

The steps between the last checkpoint and a kill were logged once already; the resumed run logs
them again (with the same values, the resume being exact). Keeping both would draw two curves, so
metrics.jsonl and the TensorBoard event files are rewritten without rows past the step the run
resumes from. Each file is replaced atomically (written beside it, then renamed).
"""

from __future__ import annotations

import json
import os

from dlmjax.observability import sinks, tensorboard

METRICS_FILE = 'metrics.jsonl'


def drop_rows_after(run_dir: str, step: int) -> int:
  """Removes logged rows with a step > `step` (metrics.jsonl and TensorBoard); returns how many
  metrics.jsonl rows went."""
  dropped = _rewrite_metrics(os.path.join(run_dir, METRICS_FILE), step)
  log_dir = os.path.join(run_dir, sinks.TENSORBOARD_DIR)
  if os.path.isdir(log_dir):
    for name in sorted(os.listdir(log_dir)):
      if name.startswith('events.out.tfevents.'):
        _rewrite_events(os.path.join(log_dir, name), step)
  return dropped


def _rewrite_metrics(path: str, step: int) -> int:
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:  # a line cut short by a kill: it belongs to no step
      continue
    if row.get('step', 0) <= step:
      kept.append(line if line.endswith('\n') else line + '\n')
  if len(kept) != len(lines):
    _replace(path, ''.join(kept).encode())
  return len(lines) - len(kept)


def _rewrite_events(path: str, step: int) -> None:
  # A record cut short by a kill is dropped with everything after it.
  records = tensorboard.read_records(path, stop_at_damage=True)
  kept = [r for r in records if tensorboard.decode_event(r).step <= step]
  if sum(16 + len(r) for r in kept) != os.path.getsize(path):
    tmp = path + '.rewrite'
    tensorboard.write_records(tmp, kept)
    os.replace(tmp, path)


def _replace(path: str, data: bytes) -> None:
  tmp = path + '.rewrite'
  with open(tmp, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)
