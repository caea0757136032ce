"""Warms the device-to-host path an async save blocks on, before the first save needs it.

On GPUs orbax copies each shard into pinned host memory (jax.device_put to the device's
'pinned_host' memory) before the save returns. The first save of a run paid 20 s for it at the
1.7B on one H200 where the later ones paid 0.4 s (docs/benchmarks.md, Checkpoints): the host
allocator grows its pinned pool on first use and keeps it. Making the same transfers once, of
zeros shaped and placed like the state's shards, on a background thread beside the train step's
compile, moves that cost off the first save.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

PINNED = 'pinned_host'


def pinned_host_available(device) -> bool:
  """Whether orbax saves through the device's pinned host memory (its default on GPUs)."""
  return jax.default_backend() == 'gpu' and any(
    m.kind == PINNED for m in device.addressable_memories()
  )


def shard_shapes(tree) -> list[tuple[object, tuple[int, ...], np.dtype]]:
  """(device, shape, dtype) of each shard a save transfers: the replica-0 shards of each array
  this process addresses, as orbax's replica slices take them."""
  out = []
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      if shard.replica_id == 0:
        out.append((shard.device, tuple(shard.data.shape), leaf.dtype))
  return out


def transfer_once(shards, memory_kind: str = PINNED) -> int:
  """Copies zeros of each (device, shape, dtype) to `memory_kind` on its device, holding every
  copy until the last lands (a save holds them all at once), then drops them. Device memory
  beyond the state's: one shard at a time. Returns the bytes transferred."""
  held, total = [], 0
  for device, shape, dtype in shards:
    x = jnp.zeros(shape, dtype, device=device)
    target = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    y = jax.device_put(x, target)
    y.block_until_ready()
    x.delete()
    held.append(y)
    total += y.nbytes
  for y in held:
    np.asarray(y)  # the save reads each copy into numpy: the same path, once
  del held
  return total


def warm_up(tree) -> threading.Thread | None:
  """Starts transfer_once for `tree`'s shards on a background thread where saves go through
  pinned host memory (GPUs); None elsewhere (the copy then has no first-use cost to hide)."""
  shards = shard_shapes(tree)
  if not shards or not pinned_host_available(shards[0][0]):
    return None

  def run():
    try:
      transfer_once(shards)
    except Exception:  # pylint: disable=broad-except
      pass  # out of host memory, say: the save then pays the first use itself, as before

  thread = threading.Thread(target=run, name='dlmjax-host-transfer-warm-up', daemon=True)
  thread.start()
  return thread
