"""Sharding rules: every large parameter is split on an 8-device mesh (MaxText's assert)."""

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.parallel import rules
from tests.conftest import tiny_test_config


def test_large_params_are_sharded():
  config = tiny_test_config(**{'mesh.fsdp': 4, 'mesh.tensor': 2})
  mesh = mesh_lib.make_mesh(config)
  _, shapes, axes = model_lib.abstract(model_lib.ModelConfig.from_config(config))
  shardings = rules.tree_shardings(mesh, axes)
  for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    per_device = np.prod(sharding.shard_shape(shape.shape))
    if np.prod(shape.shape) >= 1024:
      assert per_device * 8 == np.prod(shape.shape), (shape, sharding.spec)


def test_spec_from_logical_names():
  assert rules.spec((rules.BATCH, None)) == jax.sharding.PartitionSpec(
    ('data', 'fsdp', 'expert'), None
  )
  assert rules.spec((rules.LAYERS, rules.EMBED, rules.MLP)) == jax.sharding.PartitionSpec(
    'pipeline', ('fsdp', 'context'), 'tensor'
  )


def test_constrain_is_a_noop_without_mesh():
  x = np.ones((2, 2))
  assert rules.constrain(x, (rules.BATCH, None)) is x


def test_qkv_biases_shard_like_their_projections_outputs():
  """q/k/v biases [L, N or K, H] split over the heads exactly as q/k/v_proj's output axes, and
  the sharded forward (fsdp 2 x tensor 2, activation constraints on) equals one device's."""
  overrides = {'mesh.fsdp': 2, 'mesh.tensor': 2, 'model.qk_norm': False, 'model.qkv_bias': True}
  config = tiny_test_config(**overrides)
  mesh = mesh_lib.make_mesh(config, jax.devices()[:4])
  cfg = model_lib.ModelConfig.from_config(config)
  _, _, axes = model_lib.abstract(cfg)
  shardings = rules.tree_shardings(mesh, axes)
  attn = shardings['blocks']['attn']
  for name in 'qkv':
    bias, proj = attn[f'{name}_bias'].spec, attn[f'{name}_proj'].spec
    assert tuple(bias) == (proj[0], *proj[2:]), (name, bias, proj)  # [L, D, X, H] minus D
    assert bias[1] == 'tensor'
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: np.asarray(x + 0.1 * rng.standard_normal(x.shape), np.float32),
    model_lib.init_params(cfg, jax.random.key(0)),
  )
  tokens = rng.integers(0, cfg.vocab_size, (4, config.model.seq_len))
  want = model_lib.merge(cfg, params)(tokens)

  @jax.jit
  def sharded(p, t):
    with rules.activation_mesh(mesh):
      return model_lib.merge(cfg, p)(t)

  got = sharded(jax.device_put(params, shardings), tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
