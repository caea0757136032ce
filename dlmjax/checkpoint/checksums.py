"""Checksums of every saved array, computed where each shard lives and independent of the mesh.

An array's digest is a sum, modulo 2^32 in two independent lanes, of one hash per element; the
element's hash mixes its raw bits with its global index (murmur3's finaliser, applied along each
axis). A sum does not depend on how the array is split, so every device reduces its own shard and
only two 32-bit words per array cross devices: no process ever gathers the model, the digest of a
checkpoint saved on one mesh matches the state restored on another, and the work is one fused
elementwise pass on the accelerator (docs/faults.md, "Integrity"). One changed element changes a
lane with probability 1 - 2^-32 (both lanes: 1 - 2^-64); this guards against damaged bytes, not
against an adversary.

The manager stores `compute(params)` (and the optimizer state's) in the step's meta item,
committed atomically with the arrays; a restore or `verify` recomputes and `compare`s.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

# Bump when the digest changes, so old checkpoints are recognised instead of reported as damaged.
FORMAT = 'fold32x2-v1'
_LANE_SEEDS = (0x9E3779B9, 0x85EBCA77)


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def _mix(h):
  """murmur3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x):
  """The element's raw bits as uint32 (floats bitcast, so -0.0, NaN payloads and ulps count)."""
  size = jnp.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(
      jnp.uint32
    )
  raise ValueError(f'checksums cover 1-, 2- and 4-byte dtypes, not {x.dtype}.')


def _fold(x):
  """uint32[2]: the two lanes' sums of element hashes (see the module docstring)."""
  bits = _bits(x)
  lanes = []
  for seed in _LANE_SEEDS:
    h = jnp.full(x.shape, seed, jnp.uint32)
    for axis in range(x.ndim):  # the global index, one axis at a time (no 2^32 overflow)
      h = _mix(h + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis))
    lanes.append(jnp.sum(_mix(h ^ _mix(bits + jnp.uint32(seed))), dtype=jnp.uint32))
  return jnp.stack(lanes)


@functools.cache
def _fold_tree():
  return jax.jit(lambda tree: jax.tree.map(_fold, tree))


def dispatch(tree):
  """Starts the digests of every leaf on the devices holding them (returns at once, async)."""
  cpu = jax.devices('cpu')[0]
  # Host arrays (imports, tests) are hashed on the host's CPU device, not copied to an accelerator.
  on_device = jax.tree.map(
    lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, cpu), tree
  )
  return _fold_tree()(on_device)


def warm_up(tree) -> threading.Thread:
  """Compiles the digests of arrays shaped and sharded like `tree` on a background thread.

  The fold compiles in about a second per leaf (20 s for a run's state), which the first save
  would otherwise block training for; started before the train step compiles, the two overlap.
  `dispatch` then reuses the executable (committed arrays of the same shardings).
  """
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )

  def compile_fold():
    try:
      _fold_tree().lower(abstract).compile()
    except Exception:  # pylint: disable=broad-except
      pass  # the save's own call compiles again and raises the error where it can be reported

  thread = threading.Thread(target=compile_fold, name='dlmjax-checksum-compile', daemon=True)
  thread.start()
  return thread


def to_hex(folded) -> dict[str, str]:
  """{'blocks/attn/q_proj': 16 hex digits, ...} of `dispatch`'s result (waits for it)."""
  if jax.process_count() > 1:  # the words may sit on another process's devices: 8 bytes each
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    folded = multihost_utils.process_allgather(folded, tiled=True)
  leaves = jax.tree_util.tree_flatten_with_path(folded)[0]
  return {
    _path_name(path): ''.join(f'{int(w):08x}' for w in np.asarray(jax.device_get(leaf))[:2])
    for path, leaf in leaves
  }


def compute(tree) -> dict[str, str]:
  """The digest of every leaf of a pytree of (sharded) arrays."""
  return to_hex(dispatch(tree))


def compare(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
  """Human-readable differences (empty when all match)."""
  problems = [f'{k}: no checksum saved' for k in sorted(set(actual) - set(expected))]
  problems += [
    f'{k}: checksum saved but no such array' for k in sorted(set(expected) - set(actual))
  ]
  problems += [
    f'{k}: checksum differs (saved {expected[k]}, now {actual[k]})'
    for k in sorted(set(expected) & set(actual))
    if expected[k] != actual[k]
  ]
  return problems
