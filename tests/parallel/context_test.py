"""Context parallelism: the sequence split over 2 or 4 devices gives the single-device answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlmjax import config as config_lib
from dlmjax.model import attention
from dlmjax.parallel import rules
from tests.conftest import tiny_test_config


def _mesh(**sizes):
  shape = [sizes.get(axis, 1) for axis in config_lib.MESH_AXES]
  devices = jax.devices()[: int(np.prod(shape))]
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), config_lib.MESH_AXES)


@pytest.mark.parametrize(
  'kind,sizes',
  [
    ('bidirectional', dict(context=4)),
    ('causal', dict(context=2)),
    ('block_causal', dict(context=2, tensor=2)),
    ('two_stream', dict(context=2)),  # [x_t || x_0] of the block-diffusion objective
  ],
)
def test_attention_with_documents_and_padding_is_exact(kind, sizes):
  """Output and gradients of one attention layer whose sequence is split over 2 or 4 devices."""
  module = attention.Attention(
    d_model=32,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    norm_eps=1e-6,
    rope_theta=1e4,
    std=0.2,
    out_std=0.2,
    rngs=nnx.Rngs(0),
  )
  graphdef, params = nnx.split(module)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 16, 32)).astype(np.float32)
  segments = np.cumsum(rng.random((2, 16)) < 0.2, axis=1).astype(np.int32)
  inputs = dict(
    positions_BL=np.tile(np.arange(16), (2, 1)),
    segment_ids_BL=segments,
    valid_length_B=np.array([16, 11], np.int32),
  )

  def loss(p, x):
    out = nnx.merge(graphdef, p)(
      rules.constrain(x, (rules.BATCH, rules.LENGTH, None)),
      inputs['positions_BL'],
      kind=kind,
      block_size=4,
      backend='xla',
      segment_ids_BL=inputs['segment_ids_BL'],
      valid_length_B=inputs['valid_length_B'],
    )
    return jnp.sum(jnp.sin(out)), out

  fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  want = jax.jit(fn)(params, x)
  with rules.activation_mesh(_mesh(**sizes)):
    got = jax.jit(fn)(params, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# The whole model with the sequence split 4 ways inside pipeline stages:
# tests/parallel/pipeline_test.py::test_model_objective_matches_one_device (one shared reference).


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'mesh.context': 8}, 'seq_len=36 is not divisible by mesh.context=8'),
    ({'mesh.context': 4}, 'num_kv_heads=2 is not divisible by mesh.tensor x mesh.context = 4'),
    (
      {'mesh.context': 2, 'mesh.tensor': 4, 'model.num_kv_heads': 4},
      'num_heads=4 is not divisible by mesh.tensor x mesh.context = 8',
    ),
    (
      {'mesh.context': 4, 'model.d_model': 36, 'model.num_kv_heads': 4, 'mesh.fsdp': 2},
      'd_model=36 is not divisible by mesh.fsdp x mesh.context = 8',
    ),
  ],
)
def test_config_validation_names_the_fix(overrides, message):
  config = tiny_test_config(**{'model.seq_len': 36, 'mesh.fsdp': -1, **overrides})
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, num_devices=8)
