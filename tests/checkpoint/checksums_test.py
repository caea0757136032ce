"""Array checksums: a hand-written numpy statement of the digest, mesh independence, and a
one-ulp change named."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dlmjax.checkpoint import checksums


def _mix(h):
  h = h ^ (h >> np.uint32(16))
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> np.uint32(13))
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> np.uint32(16))


def _reference(x: np.ndarray) -> str:
  """The digest as the module docstring states it, element by element in numpy."""
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint32)
  words = []
  with np.errstate(over='ignore'):
    for seed in (0x9E3779B9, 0x85EBCA77):
      total = np.uint32(0)
      for index in np.ndindex(x.shape):
        h = np.uint32(seed)
        for i in index:
          h = _mix(h + np.uint32(i))
        total = total + _mix(h ^ _mix(bits[index] + np.uint32(seed)))
      words.append(f'{int(total):08x}')
  return ''.join(words)


def test_digest_matches_the_written_out_formula():
  rng = np.random.default_rng(0)
  tree = {
    'w': rng.standard_normal((3, 5)).astype(np.float32),
    'b': {'v': rng.integers(-9, 9, (4,)).astype(np.int32), 's': np.float32(-0.0)},
    'h': jnp.asarray(rng.standard_normal((2, 3)), jnp.bfloat16),
  }
  digests = checksums.compute(tree)
  assert digests == {
    'w': _reference(tree['w']),
    'b/v': _reference(tree['b']['v']),
    'b/s': _reference(np.asarray(tree['b']['s'])),
    'h': _reference(np.asarray(tree['h'])),
  }


def test_digest_is_independent_of_the_sharding_and_names_a_one_ulp_change():
  x = np.random.default_rng(1).standard_normal((8, 16, 4)).astype(np.float32)
  devices = np.asarray(jax.devices()[:8])
  whole = checksums.compute({'x': x})
  for shape, spec in [((8,), PartitionSpec('a')), ((2, 4), PartitionSpec('b', 'a'))]:
    mesh = Mesh(devices.reshape(shape), ('a', 'b')[: len(shape)])
    assert checksums.compute({'x': jax.device_put(x, NamedSharding(mesh, spec))}) == whole
  changed = x.copy()
  changed[5, 3, 1] = np.nextafter(changed[5, 3, 1], np.inf)
  problems = checksums.compare(whole, checksums.compute({'x': changed}))
  assert len(problems) == 1 and problems[0].startswith('x: checksum differs')
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places: the index is in the hash
  assert checksums.compute({'x': swapped}) != whole
  assert checksums.compare(whole, {}) == ['x: checksum saved but no such array']


def test_warm_up_compiles_what_a_save_then_reuses():
  """A save's first checksums reuse the warm-up's executable: no compile while training waits."""
  mesh = jax.make_mesh((1,), ('fsdp',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp'))
  tree = {'w': jax.device_put(np.arange(35.0, dtype=np.float32).reshape(7, 5), sharding)}
  checksums.warm_up(tree).join()
  compiled = []
  with jax.log_compiles():
    handler = logging.Handler()
    handler.emit = lambda record: compiled.append(record.getMessage())
    logger = logging.getLogger('jax')
    logger.addHandler(handler)
    try:
      digest = checksums.compute(tree)
    finally:
      logger.removeHandler(handler)
  assert not [m for m in compiled if 'Finished XLA compilation' in m], compiled
  assert digest == checksums.compute({'w': np.arange(35.0, dtype=np.float32).reshape(7, 5)})
