"""The Pallas RMSNorm kernels against the XLA formula (layers.rms_norm / rotary_embedding).

On CPU the kernels run in interpret mode; the Triton lowering is checked by lowering for CUDA,
and the `gpu` test runs it at the 1.7B shapes in bf16.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.kernels import rms_norm as kernel
from dlmjax.model import layers
from dlmjax.parallel import rules
from tests.conftest import tiny_test_config
from tests.parallel import pipeline_test

EPS = 1e-6
# Tiles of 2 tokens, 3 per backward program: the loop, the partial sums and the row padding
# (13 tokens, not a multiple of 6) all take part.
SMALL = kernel.Blocks(elements=128, steps=3, num_warps=4)


def _case(seed, shape, dtype, rope):
  k = jax.random.split(jax.random.key(seed), 5)
  x = (3 * jax.random.normal(k[0], shape, jnp.float32)).astype(dtype)
  scale = (1 + 0.3 * jax.random.normal(k[1], shape[-1:], jnp.float32)).astype(dtype)
  g = tuple(jax.random.normal(k[2 + i], shape, jnp.float32).astype(dtype) for i in range(2))
  positions = jax.random.randint(k[4], shape[:2], 0, 4096)
  cos, sin = layers.rope_tables(positions, shape[-1], 1e4) if rope else (None, None)
  return x, scale, g, positions, cos, sin


def _vjp(fn, x, scale, cotangent):
  y, vjp = jax.vjp(fn, x, scale)
  return y, *vjp(cotangent)


def _assert_close(got, want, tol):
  for name, a, b in zip(('y', 'dx', 'dscale'), got, want):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < tol, (name, err)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('rope', [False, True])
def test_matches_the_formula(dtype, rope):
  shape = (1, 13, 4, 16) if rope else (1, 13, 32)
  x, scale, g, positions, cos, sin = _case(0, shape, dtype, rope)

  def ours(x, s):
    return kernel.rms_norm(x, s, eps=EPS, cos=cos, sin=sin, blocks=SMALL)

  def formula(x, s):
    y = layers.rms_norm(x, s, EPS)
    return layers.rotary_embedding(y, positions, 1e4) if rope else y

  got = jax.jit(lambda x, s, g: _vjp(ours, x, s, g))(x, scale, g[0])
  want = jax.jit(lambda x, s, g: _vjp(formula, x, s, g))(x, scale, g[0])
  if dtype == jnp.float32:
    _assert_close(got, want, 1e-5)
  else:  # both round to bf16; against the f32 formula they err alike, so compare each to it.
    exact = jax.jit(lambda x, s, g: _vjp(formula, x, s, g))(
      *(a.astype(jnp.float32) for a in (x, scale, g[0]))
    )
    _assert_close(got, exact, 1e-2)
    _assert_close(got[:1], want[:1], 4e-3)  # y: the same roundings, at most an ulp apart


def test_residual_adds_the_stream_gradient():
  x, scale, (g_stream, g_norm), *_ = _case(1, (2, 7, 64), jnp.float32, False)

  def ours(x, s):
    return kernel.rms_norm_residual(x, s, eps=EPS, blocks=SMALL)

  def formula(x, s):
    return x, layers.rms_norm(x, s, EPS)

  (x_out, y), dx, dscale = _vjp(ours, x, scale, (g_stream, g_norm))
  (_, y_ref), dx_ref, dscale_ref = _vjp(formula, x, scale, (g_stream, g_norm))
  np.testing.assert_array_equal(x_out, x)
  _assert_close((y, dx, dscale), (y_ref, dx_ref, dscale_ref), 1e-5)


def test_model_with_pallas_norms_matches_xla_norms():
  cfg = model_lib.ModelConfig(
    num_layers=2,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    vocab_size=128,
    seq_len=16,
    remat='save_activations',
  )
  params = model_lib.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(  # gains away from 1, so a wrong d(scale) shows
    lambda p: p + 0.2 * jax.random.normal(jax.random.key(2), p.shape) if p.ndim < 3 else p, params
  )
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)

  def run(cfg):
    def loss(p):
      return (model_lib.merge(cfg, p)(tokens) ** 2).mean()

    return jax.jit(jax.value_and_grad(loss))(params)

  want, g_want = run(cfg)
  got, g_got = run(dataclasses.replace(cfg, norm_backend='pallas'))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_sharded_matches_unsharded():
  """Per-shard kernels under a data x tensor mesh: the scale's gradient sums over shards."""
  x, scale, g, positions, cos, sin = _case(2, (4, 8, 4, 16), jnp.float32, True)

  def loss(x, s):
    norm = layers.RMSNorm(16, eps=EPS, rngs=nnx.Rngs(0), backend='pallas')
    norm.scale.value = s
    return (norm.with_rope(x, positions, 1e4) * g[0]).sum()

  want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, scale)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 2, 1, 1, 2), config_lib.MESH_AXES)
  with rules.activation_mesh(mesh):
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, scale)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~22 s on 2 cores
def test_train_objective_on_a_pipeline_tensor_data_mesh_matches_one_device():
  """The kernels inside the pipeline's vmapped stages, per shard of heads and rows."""
  base = {'model.num_layers': 4, 'model.num_kv_heads': 4, 'mesh.fsdp': 1}
  want = pipeline_test.objective_and_grads(tiny_test_config(**base))
  got = pipeline_test.objective_and_grads(
    tiny_test_config(
      **base,
      **{'model.norm_backend': 'pallas', 'mesh.pipeline': 2, 'mesh.tensor': 2, 'mesh.data': 2},
    )
  )
  pipeline_test.assert_same(got, want)


@pytest.mark.parametrize('rope', [False, True])
def test_lowers_for_triton(rope):
  """The Triton lowering (what a GPU compiles) of forward and backward, at the 1.7B shapes."""
  shape = (8, 2048, 16, 128) if rope else (8, 2048, 2048)
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  scale = jax.ShapeDtypeStruct(shape[-1:], jnp.bfloat16)
  table = jax.ShapeDtypeStruct((*shape[:2], shape[-1] // 2), jnp.float32)

  def fwd_bwd(x, scale, cos, sin, g):
    if rope:
      return _vjp(
        lambda x, s: kernel.rms_norm(x, s, eps=EPS, cos=cos, sin=sin, interpret=False), x, scale, g
      )
    return _vjp(
      lambda x, s: kernel.rms_norm_residual(x, s, eps=EPS, interpret=False), x, scale, (g, g)
    )

  text = (
    jax.jit(fwd_bwd).trace(x, scale, table, table, x).lower(lowering_platforms=('cuda',)).as_text()
  )
  assert text.count('__gpu$xla.gpu.triton') == 2, text[:2000]


def test_supported_and_config_name_the_problem():
  assert kernel.supported(16, 128, rope=True) is None
  assert 'power-of-two heads' in kernel.supported(12, 128, rope=True)
  assert 'power-of-two row width' in kernel.supported(1, 96, rope=False)
  config = tiny_test_config(**{'model.norm_backend': 'pallas', 'model.d_model': 96})
  with pytest.raises(
    config_lib.ConfigError, match='norm_backend=pallas needs a power-of-two model.d_model'
  ):
    config_lib.validate(config)
  config_lib.validate(tiny_test_config(**{'model.norm_backend': 'auto', 'model.d_model': 96}))
  with pytest.raises(ValueError, match='power-of-two row width, got 96; use model.norm_backend'):
    kernel.rms_norm_residual(jnp.ones((2, 96)), jnp.ones(96), eps=EPS, interpret=False)


def test_auto_is_the_formula_off_gpu():
  norm = layers.RMSNorm(16, eps=EPS, rngs=nnx.Rngs(0), backend='auto')
  text = str(jax.make_jaxpr(norm)(jnp.ones((2, 3, 16))))
  assert 'pallas_call' not in text and 'rsqrt' in text


@pytest.mark.gpu
@pytest.mark.parametrize('rope', [False, True])
def test_gpu_bf16_matches_the_formula(rope):
  shape = (2, 2048, 16, 128) if rope else (2, 2048, 2048)
  x, scale, g, positions, cos, sin = _case(3, shape, jnp.bfloat16, rope)

  def ours(x, s):
    if rope:
      return kernel.rms_norm(x, s, eps=EPS, cos=cos, sin=sin)
    return kernel.rms_norm_residual(x, s, eps=EPS)[1]

  def formula(x, s):
    y = layers.rms_norm(x, s, EPS)
    return layers.rotary_embedding(y, positions, 1e4) if rope else y

  got = jax.jit(lambda x, s, g: _vjp(ours, x, s, g))(x, scale, g[0])
  exact = jax.jit(lambda x, s, g: _vjp(formula, x, s, g))(
    *(a.astype(jnp.float32) for a in (x, scale, g[0]))
  )
  _assert_close(got, exact, 1e-2)
