"""Run-time checks that turn cluster and data faults into one clear error naming the fix.

Before any model is built: the files the run reads (data prefixes, tokenizer, SFT and task
files). Before training: free disk for the next checkpoint. Every step: the batch's token ids and
the data files behind it. Around the loop: device out-of-memory, translated into the knobs that
help.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import jax
import numpy as np

from dlmjax.config import UserError
from dlmjax.data.errors import DataError
from dlmjax.train import stages

# orbax writes arrays uncompressed plus small metadata; keep a margin for it and the filesystem.
_CHECKPOINT_MARGIN = 1.1


class ResourceError(UserError, RuntimeError):
  """Not enough disk or device memory for the run as configured; the message names the knobs."""


def check_inputs(config) -> None:
  """Fails in a second, before any model is built, when a file the run will read is missing:
  each failure one line naming the path and the key to fix. The stage checks its own inputs
  (Stage.check_inputs: data prefixes, the SFT file, the RL task's files)."""
  data = config.data
  stages.build(config).check_inputs()
  if data.tokenizer and not os.path.isfile(data.tokenizer):
    raise DataError(
      f'data.tokenizer {data.tokenizer!r} is not a file; set --config.data.tokenizer to a '
      "tokenizer.json or tokenizer.model, or to '' for the built-in corpus's."
    )


def checkpoint_bytes(state_shapes) -> int:
  """Bytes of one checkpoint of the train state (params + optimizer state + step)."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state_shapes))


def checkpoints_on_disk(config) -> int:
  """How many checkpoints of this run can sit on disk at once: checkpoint.keep, plus the one
  being written before the oldest is deleted, plus checkpoint.keep_every's milestones."""
  copies = config.checkpoint.keep + 1
  if config.checkpoint.keep_every > 0:
    copies += config.train.steps // config.checkpoint.keep_every
  return copies


def check_free_disk(output_dir: str, state_shapes, copies: int = 1) -> str:
  """Fails before training when output_dir cannot hold `copies` checkpoints (checkpoints_on_disk
  of the config); returns the line saying what was checked. Space this run's own checkpoints
  hold already (a resume) counts as free: they are among the copies."""
  one = int(checkpoint_bytes(state_shapes) * _CHECKPOINT_MARGIN)
  needed = one * copies
  free = shutil.disk_usage(output_dir).free + _bytes_under(os.path.join(output_dir, 'checkpoints'))
  if free < needed:
    raise ResourceError(
      f'output_dir {output_dir} has {_gib(free)} free, but {copies} checkpoints of this run '
      f'(checkpoint.keep + 1 while the next is written, plus milestones) need about '
      f'{_gib(needed)} ({_gib(one)} each: params + optimizer state). Free some space, lower '
      '--config.checkpoint.keep (or raise checkpoint.keep_every), or set --config.output_dir to '
      'a larger disk.'
    )
  return (
    f'disk: {_gib(free)} free in {output_dir} holds the {copies} checkpoints of {_gib(one)} '
    'this run keeps at once (checkpoint.keep + 1, plus milestones)'
  )


def _bytes_under(directory: str) -> int:
  total = 0
  for root, _, files in os.walk(directory):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def _gib(n: int) -> str:
  return f'{n / 2**30:.2f} GiB'


def describe_data_source(config) -> str:
  data = config.data
  if data.source == 'megatron':
    return f'data.train_prefixes {data.train_prefixes!r}'
  return f'data.source {data.source!r}'


def next_batch(batches, params, config, step: int) -> tuple[dict[str, np.ndarray], dict | None]:
  """The stage's next host batch and row (BatchSource.next), checked: a vanished or unreadable
  data file names itself, and token ids must lie in the vocabulary."""
  try:
    batch, row = batches.next(params)
  except OSError as e:
    name = e.filename or describe_data_source(config)
    raise DataError(
      f'reading the batch of step {step} failed: {name}: {e.strerror or e}. A data file was '
      'moved, deleted or became unreadable during the run; restore it and start the same '
      'command again (it resumes from the last checkpoint).'
    ) from e
  check_token_ids(batch['tokens'], config, step)  # every stage's model input (Stage.batch_keys)
  return batch, row


def check_token_ids(tokens: np.ndarray, config, step: int) -> None:
  """Token ids outside [0, model.vocab_size) would index past the embedding silently on GPU."""
  vocab = config.model.vocab_size
  bad = (tokens < 0) | (tokens >= vocab)
  if not bad.any():
    return
  row, position = (int(i) for i in np.argwhere(bad)[0])
  raise DataError(
    f'the batch of step {step} ({describe_data_source(config)}) has {int(bad.sum())} token ids '
    f'outside [0, {vocab}), first {int(tokens[row, position])} at row {row}, position '
    f"{position}. Re-tokenize the data with the model's tokenizer, or set "
    "--config.model.vocab_size to the tokenizer's vocabulary."
  )


OOM_HINT = (
  'reduce --config.train.micro_batch_size (gradients accumulate to the same global '
  'batch), turn on --config.model.remat=full (or save_dots), or shard parameters and '
  'optimizer state over more devices with --config.mesh.fsdp; '
  '`python -m dlmjax.summary` shows the memory per device.'
)


@contextlib.contextmanager
def explain_out_of_memory():
  """Re-raises a device RESOURCE_EXHAUSTED error as a ResourceError naming the memory knobs."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else 'RESOURCE_EXHAUSTED'
    raise ResourceError(
      f'the device ran out of memory ({first_line[:300]}). To fit, ' + OOM_HINT
    ) from e
