"""A step's meta item: the JSON beside its arrays that proves them whole.

It holds the step, the data iterator's state, the sha256 of both, the checksums of every array
item and their layout (dtypes and shapes). Both resume (checkpoint/manager.py) and
`python -m dlmjax.verify` test a step through `check_meta`, so the two never disagree.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax

from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import run_dir as run_dir_lib

ITEMS = ('params', 'opt_state', 'reference', 'meta')  # reference: RL's refreshed KL reference
# The meta item's version marker. A meta that carries it, or any of the integrity keys, was
# written by a version that records checksums and must hold all of them; only a meta with none
# (a checkpoint from before checksums) loads unverified, and says so (docs/faults.md, Integrity).
META_FORMAT = 2
_INTEGRITY_KEYS = ('checksums', 'checksum_format', 'meta_checksum')


class DamagedCheckpoint(Exception):
  """The bytes of one step are unreadable or do not match their checksums (set aside)."""


def layout(tree) -> dict[str, str]:
  """{'params/embed/embedding': 'float32[4096,64]', ...}: what a restore target must match."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    checksums._path_name(path): f'{jax.numpy.dtype(x.dtype).name}{list(x.shape)}'  # pylint: disable=protected-access
    for path, x in leaves
  }


def meta_digest(step: int, data_state) -> str:
  """sha256 of the step and data-iterator state (the meta item's own checksum)."""
  text = json.dumps(dict(step=step, data_state=data_state), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def saved_checksums(meta: dict, item: str = 'params') -> dict | None:
  """The digests saved for `item` ('params' or 'opt_state'), or None when this checkpoint holds
  none in the current format (saved before it existed: nothing to compare with)."""
  if meta.get('checksum_format') != checksums.FORMAT:
    return None
  return meta.get('checksums' if item == 'params' else f'{item}_checksums')


def predates_checksums(meta: dict) -> bool:
  """Whether the meta comes from before checksums were written: no version marker and none of
  the integrity keys (a later meta missing some of them is damaged, not old)."""
  return 'format' not in meta and not any(k in meta for k in _INTEGRITY_KEYS + ('layout',))


def check_meta(meta: dict, step: int, items=('params',)) -> bool:
  """Raises DamagedCheckpoint unless the meta item is whole and its step and data state match
  their sha256; `items` are the array items to be read. Returns False for a checkpoint from
  before checksums (nothing to verify), True when every digest is there to compare.

  The one test of a step's meta for both resume and `python -m dlmjax.verify`."""
  if meta.get('step') != step:
    raise DamagedCheckpoint(f'meta: the step ({meta.get("step")!r}) is not {step}')
  if predates_checksums(meta):
    return False
  wanted = list(_INTEGRITY_KEYS) + [f'{i}_checksums' for i in items if i != 'params']
  missing = [k for k in wanted if k not in meta]
  if missing:
    raise DamagedCheckpoint(
      f'meta: {", ".join(missing)} missing, though it was written by a version that records them'
    )
  if meta['checksum_format'] != checksums.FORMAT:
    raise DamagedCheckpoint(
      f'meta: checksum_format {meta["checksum_format"]!r} is not {checksums.FORMAT!r}, the '
      'only one this version writes'
    )
  if meta['meta_checksum'] != meta_digest(step, meta.get('data_state')):
    raise DamagedCheckpoint(
      f'meta: the step ({step}) or data-iterator state does not match its checksum'
    )
  return True


def read_meta(step_dir: str) -> dict:
  """The step's JSON item: step, data iterator state and the params' sha256 checksums."""
  path = os.path.join(step_dir, 'meta', 'metadata')
  if not os.path.exists(path):
    raise run_dir_lib.CheckpointError(f'{path} is missing: the checkpoint is incomplete.')
  with open(path) as f:
    return json.load(f)
