"""The save's device-to-host warm-up: the shards it copies are the ones a save copies, each once,
and it stays off where saves do not go through pinned host memory."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dlmjax.checkpoint import host_transfer


def _tree():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('data', 'fsdp'))
  split = NamedSharding(mesh, PartitionSpec('fsdp', None))  # 2 shards, each on 2 devices
  whole = NamedSharding(mesh, PartitionSpec())  # replicated on all 4
  return dict(
    w=jax.device_put(jnp.ones((8, 6), jnp.float32), split),
    b=jax.device_put(jnp.ones((6,), jnp.bfloat16), whole),
  )


def test_each_distinct_shard_is_copied_once_to_pinned_host_memory():
  tree = _tree()
  shards = host_transfer.shard_shapes(tree)
  assert sorted((shape, str(dtype)) for _, shape, dtype in shards) == [
    ((4, 6), 'float32'),
    ((4, 6), 'float32'),
    ((6,), 'bfloat16'),
  ]
  # the replica-0 copies of the split array sit on two different devices
  assert len({device for device, shape, _ in shards if shape == (4, 6)}) == 2
  moved = host_transfer.transfer_once(shards)
  assert moved == sum(x.nbytes for x in tree.values())


def test_no_warm_up_thread_where_saves_skip_pinned_host_memory():
  assert jax.default_backend() == 'cpu'  # orbax copies to pinned host memory only on GPUs
  assert not host_transfer.pinned_host_available(jax.devices()[0])
  assert host_transfer.warm_up(_tree()) is None
