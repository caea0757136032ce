"""What a checkpoint's data position means: the dataset fingerprint saved beside it.

The data state counts samples consumed (or rollouts served); that count means the same samples
only on the same data. The fingerprint records the stage's data keys (Stage.data_keys: source,
prefixes and blend, split, seq_len, seed, ...) and the size of every local file they name, and a
resume whose fingerprint differs is refused with one line naming the keys, unless
`data.new_phase` says the change is intended: the data position then restarts at the new data's
first sample (the model, optimizer and step resume). The switch does nothing when the data are
unchanged, so the same command, with it still set, resumes a preempted new phase exactly.
"""

from __future__ import annotations

import os

import jax

from dlmjax import config as config_lib
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.data import blend

KEY = 'dataset'  # the fingerprint's key inside the saved data state


def _megatron_files(value: str) -> list[str]:
  if not value.strip():
    return []
  return [p + ext for p in blend.parse_blend(value)[0] for ext in ('.bin', '.idx')]


def _record_files(value: str) -> list[str]:
  return [p for p in value.split(',') if p.strip()]


# Keys that name files: the fingerprint records each local file's size (hub: names have none).
_FILES_OF = {
  'data.train_prefixes': _megatron_files,
  'data.valid_prefixes': _megatron_files,
  'sft.train_file': _record_files,
  'sft.teacher_file': _record_files,
  'rl.task_data': _record_files,
}


def fingerprint(config, keys) -> dict:
  """{key: value, ..., 'sizes': {path: bytes}} of the stage's data keys."""
  out = {key: config_lib.get_key(config, key) for key in keys}
  sizes = {}
  for key in keys:
    for path in _FILES_OF.get(key, lambda _: [])(config_lib.get_key(config, key)):
      if os.path.isfile(path):
        sizes[os.path.abspath(path)] = os.path.getsize(path)
  if sizes:
    out['sizes'] = sizes
  return out


def stamp(position: dict | None, dataset: dict) -> dict | None:
  """The data state to save: the iterator's position with the dataset it counts in."""
  return None if position is None else {**position, KEY: dataset}


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def position_to_resume(saved: dict | None, dataset: dict, config) -> dict | None:
  """The iterator position to resume at, from a checkpoint's data state: the saved one on the
  same data; None (start at the first sample) for a new phase (data.new_phase) on other data.
  Raises CheckpointError (one line) for other data without the switch."""
  if saved is None:
    return None
  position = {k: v for k, v in saved.items() if k != KEY}
  before = saved.get(KEY)
  if before is None:  # saved before data states carried a fingerprint: nothing to compare
    _say('the checkpoint predates dataset fingerprints: its data position is taken as is.')
    return position
  differing = [k for k in sorted(set(before) | set(dataset)) if before.get(k) != dataset.get(k)]
  if not differing:
    return position
  if config.data.new_phase:
    _say(
      f'data.new_phase: the data changed ({", ".join(differing)}); the data position restarts '
      f'at the first sample (it was {position}); the model, optimizer and step resume.'
    )
    return None
  details = '; '.join(
    f'{k}: checkpoint {_short(before.get(k))}, run {_short(dataset.get(k))}' for k in differing
  )
  raise run_dir_lib.CheckpointError(
    f"the checkpoint's data position counts samples of other data ({details}). Set these keys "
    "back to the checkpoint's values to resume, or --config.data.new_phase=True to train on "
    'this data from its first sample (a new phase of training; model and optimizer resume).'
  )


def _say(line: str) -> None:
  if jax.process_index() == 0:
    print(line, flush=True)
