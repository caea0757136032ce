"""Parameter checksums: stable, independent of placement, and a change is named."""

import jax
import numpy as np

from dlmjax.checkpoint import checksums


def test_compute_and_compare():
  params = {'a': np.arange(6, dtype=np.float32), 'b': {'c': np.ones((2, 3), np.float32)}}
  digests = checksums.compute(params)
  assert set(digests) == {'a', 'b/c'}
  assert digests == checksums.compute(jax.tree.map(jax.numpy.asarray, params))
  assert checksums.compare(digests, checksums.compute(params)) == []
  params['b']['c'][1, 2] = 2.0
  problems = checksums.compare(digests, checksums.compute(params))
  assert len(problems) == 1 and problems[0].startswith('b/c: sha256 differs')
  del params['a']
  assert 'a: checksum saved but no such parameter' in checksums.compare(
    digests, checksums.compute(params)
  )


def test_large_sharded_leaves_hash_in_slabs_to_the_same_digest(monkeypatch):
  """Slab by slab (what bounds host memory for a huge multi-host leaf) = the whole array."""
  import hashlib  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  x = np.random.default_rng(0).standard_normal((7, 8, 4)).astype(np.float32)
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8), ('d',))
  sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, 'd')))
  monkeypatch.setattr(checksums, 'SLAB_BYTES', 3 * 8 * 4 * 4)  # 3 rows: slabs of 3, 3, 1
  assert len(list(checksums._host_slabs(sharded))) == 3  # pylint: disable=protected-access
  assert checksums.digest(sharded) == hashlib.sha256(x.tobytes()).hexdigest()
