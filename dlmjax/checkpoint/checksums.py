"""SHA-256 of every parameter, saved with a checkpoint so `verify` can prove it unchanged.

A digest covers the array's C-order little-endian bytes, after gathering it whole, so it does not
depend on the mesh the checkpoint was saved or restored on. The manager stores `compute(params)`
in the step's meta item (committed atomically with the arrays); `verify` recomputes and `compare`s.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from dlmjax.parallel import distributed


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


# A leaf larger than this reaches the host in leading-axis slabs (every process receives each
# gathered slab, so a 70B layer stack never sits whole in host memory).
SLAB_BYTES = 1 << 29


def digest(array) -> str:
  """sha256 of the C-order bytes: hashing consecutive leading-axis slabs gives the same bytes."""
  sha = hashlib.sha256()
  for slab in _host_slabs(array):
    host = np.ascontiguousarray(slab)
    if host.dtype.byteorder == '>':
      host = host.astype(host.dtype.newbyteorder('<'))
    sha.update(memoryview(host.reshape(-1).view(np.uint8)))
  return sha.hexdigest()


def _host_slabs(array):
  nbytes = getattr(array, 'nbytes', 0)
  if not isinstance(array, jax.Array) or array.ndim == 0 or nbytes <= SLAB_BYTES:
    yield distributed.to_host(array)
    return
  rows = max(1, SLAB_BYTES // (nbytes // array.shape[0]))
  for start in range(0, array.shape[0], rows):
    # Every process slices alike (a collective).
    yield distributed.to_host(array[start : start + rows])


def compute(params) -> dict[str, str]:
  """{'blocks/attn/q_proj': sha256 hex, ...} for every leaf (one leaf on the host at a time)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {_path_name(path): digest(leaf) for path, leaf in leaves}


def compare(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
  """Human-readable differences (empty when all match)."""
  problems = [f'{k}: no checksum saved' for k in sorted(set(actual) - set(expected))]
  problems += [
    f'{k}: checksum saved but no such parameter' for k in sorted(set(expected) - set(actual))
  ]
  problems += [
    f'{k}: sha256 differs (saved {expected[k][:12]}..., now {actual[k][:12]}...)'
    for k in sorted(set(expected) & set(actual))
    if expected[k] != actual[k]
  ]
  return problems
