"""The teacher's rows for distillation: its completions and the step that committed each token.

One .npz of int32 arrays [rows, model.seq_len + 1] in the SFT row layout (train/sft_rows.py
padded_rows): `tokens` (prompt, the teacher's completion, EOS padding), `roles` (PROMPT |
RESPONSE through the completion's first EOS | PADDING) and `commit_steps` (the sampler's `steps`
record: the decode step that committed each completion token, -1 on the prompt and padding).
Written by `python -m dlmjax.distill`, read by the SFT stage when sft.objective distils.
"""

from __future__ import annotations

import os

import numpy as np

from dlmjax.data.errors import DataError

KEYS = ('tokens', 'roles', 'commit_steps')


def write(path: str, rows: dict) -> str:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}.npz'
  np.savez(tmp, **{k: np.asarray(rows[k], np.int32) for k in KEYS})
  os.replace(tmp, path)
  return path


def read(path: str, width: int) -> dict[str, np.ndarray]:
  """The rows of `path`, checked against the canvas (width = model.seq_len + 1)."""
  if not os.path.isfile(path):
    raise DataError(
      f'sft.teacher_file {path!r} is not a file; write it with `python -m dlmjax.distill '
      '--init-from RUN --output FILE.npz` and set --config.sft.teacher_file=FILE.npz.'
    )
  with np.load(path) as f:
    missing = [k for k in KEYS if k not in f]
    if missing:
      raise DataError(
        f'{path}: teacher rows lack {missing}; rewrite it with python -m dlmjax.distill.'
      )
    rows = {k: np.asarray(f[k], np.int32) for k in KEYS}
  if rows['tokens'].ndim != 2 or rows['tokens'].shape[1] != width:
    raise DataError(
      f'{path}: teacher rows are {rows["tokens"].shape[1:]} wide, not model.seq_len + 1 = '
      f"{width}; write them with the run's model.seq_len."
    )
  return rows
