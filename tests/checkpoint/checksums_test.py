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
      digests, checksums.compute(params))
