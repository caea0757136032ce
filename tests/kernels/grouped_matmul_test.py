"""The grouped matmul against a dense reference (each row times its group's matrix), forward and
both gradients, for XLA's ragged_dot, our Pallas kernels (interpret mode off GPU) and (where it
imports) tokamax's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.kernels import grouped_matmul as gmm

# auto is one of these wherever it runs (its choice: the resolve test below).
BACKENDS = ['xla', 'pallas']
BACKENDS += ['tokamax'] if gmm.tokamax_available() else []


def _dense(lhs, rhs, sizes):
  """lhs[r] @ rhs[g(r)], zero past the groups: every group on every row, one-hot masked."""
  group_R = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(lhs.shape[0]), side='right')
  one_hot_RG = jax.nn.one_hot(group_R, rhs.shape[0], dtype=lhs.dtype)  # all zeros past the groups
  return jnp.einsum('rk,gkn,rg->rn', lhs, rhs, one_hot_RG)


@pytest.mark.parametrize('backend', BACKENDS)
def test_grouped_matmul_matches_the_dense_reference_forward_and_backward(backend):
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (12, 4))
  rhs = jax.random.normal(keys[1], (4, 4, 3))
  sizes = jnp.array([3, 0, 5, 2])  # an empty group, and 2 rows past every group
  cot = jax.random.normal(keys[2], (12, 3))

  def both(lhs, rhs):
    got, got_vjp = jax.vjp(lambda a, b: gmm.grouped_matmul(a, b, sizes, backend=backend), lhs, rhs)
    want, want_vjp = jax.vjp(lambda a, b: _dense(a, b, sizes), lhs, rhs)
    return (got, *got_vjp(cot)), (want, *want_vjp(cot))

  got, want = jax.jit(both)(lhs, rhs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert not np.any(got[0][10:]) and not np.any(got[1][10:])  # no group: zero out, zero gradient


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_stacked_rhs_read_at_a_traced_layer_is_that_layers_product(backend):
  """The inference layout's read (layer: rhs [layers, G, K, N], a traced index) against the
  dense reference of rhs[layer] in numpy; every layer differs, so a kernel that read another
  layer (or layer 0) would miss. Pallas: no padding (K, N whole 16-tiles) and padding (12, 20)."""
  for depth, width in ((16, 32), (12, 20)):
    keys = jax.random.split(jax.random.key(depth), 2)
    lhs = jax.random.normal(keys[0], (20, depth))
    rhs = jax.random.normal(keys[1], (3, 4, depth, width))  # 3 layers of 4 groups
    sizes = jnp.array([3, 0, 9, 5])  # an empty group, and 3 rows past every group
    run = jax.jit(lambda a, b, layer: gmm.grouped_matmul(a, b, sizes, backend=backend, layer=layer))
    for layer in (2, 1):
      got = np.asarray(run(lhs, rhs, layer))
      want = np.asarray(_dense(lhs, rhs[layer], sizes))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(
        got, gmm.grouped_matmul(lhs, rhs[layer], sizes, backend=backend)
      )
  with pytest.raises(ValueError, match=r'rhs \[layers, G, K, N\] with a layer'):
    gmm.grouped_matmul(lhs, rhs[0], sizes, backend='pallas', layer=0)


def test_unknown_backend_names_the_choices():
  with pytest.raises(ValueError, match="backend 'cuda' is not one of"):
    gmm.resolve('cuda')


def test_auto_takes_pallas_on_gpu_and_a_failing_tokamax_names_its_failures(monkeypatch):
  """auto is the measured kernel on GPU (docs/benchmarks.md, MoE) and XLA elsewhere; tokamax
  0.0.12 under jax 0.11.2 raised inside its Mosaic GPU kernel (a TypeError while tracing): backend
  tokamax tries each implementation once and names both failures in one line."""

  class Broken:
    calls = 0

    def ragged_dot(self, *args, implementation, **kwargs):
      Broken.calls += 1
      raise TypeError(
        f"Mesh.__init__() got an unexpected keyword argument 'out_shape' ({implementation})"
      )

  assert gmm.resolve('auto') == 'xla'  # the CPU
  monkeypatch.setattr(gmm, '_tokamax', Broken)
  monkeypatch.setattr(gmm.jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(gmm, '_failures', {})
  assert gmm.resolve('auto') == 'pallas'
  lhs = jnp.arange(12.0).reshape(6, 2)
  rhs = jnp.arange(12.0).reshape(3, 2, 2)
  sizes = jnp.array([2, 1, 2])
  for _ in range(2):
    with pytest.raises(ValueError, match=r'tokamax failed here.*out_shape.*use backend pallas'):
      gmm.grouped_matmul(lhs, rhs, sizes, backend='tokamax')
  assert Broken.calls == 2  # mosaic, then triton; never again


def test_model_moe_backend_reaches_the_expert_matmuls():
  """model.moe.backend=pallas puts the kernel into the model's experts (traced, not compiled);
  a bad value names the choices."""
  from dlmjax import config as config_lib
  from dlmjax import model as model_lib
  from tests.conftest import tiny_test_config

  moe = {'model.moe.num_experts': 4, 'model.moe.experts_per_token': 2, 'model.moe.ffn_dim': 16}
  config = tiny_test_config(**moe, **{'model.moe.backend': 'pallas', 'model.num_layers': 1})
  cfg = model_lib.ModelConfig.from_config(config)
  _, params, _ = model_lib.abstract(cfg)
  text = str(
    jax.make_jaxpr(lambda p, t: model_lib.merge(cfg, p)(t))(params, jnp.zeros((1, 8), int))
  )
  assert 'grouped_matmul_fwd' in text and 'ragged_dot' not in text
  with pytest.raises(config_lib.ConfigError, match='model.moe.backend'):
    config_lib.validate(tiny_test_config(**moe, **{'model.moe.backend': 'triton'}))
