"""FP8 projections: against a numpy quantize-dequantize reference, bf16, and through the model."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.model import fp8, layers, programs
from tests.conftest import tiny_test_config

_FP8 = {'e4m3': (ml_dtypes.float8_e4m3fn, 448.0), 'e5m2': (ml_dtypes.float8_e5m2, 57344.0)}


def _np_qdq(x, fmt):
  """Hand-written quantize-dequantize: power-of-two scale from amax, saturate, round to fp8."""
  dtype, fp8_max = _FP8[fmt]
  x = np.asarray(x, np.float32)
  scale = 2.0 ** np.ceil(np.log2(np.abs(x).max() / fp8_max))
  q = np.clip(x / scale, -fp8_max, fp8_max).astype(dtype)
  return q.astype(np.float64) * scale


def _inputs(seed, x_shape, w_shape, x_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  # A wide dynamic range (log-normal magnitudes) so the scale and the rounding both matter.
  x = rng.normal(size=x_shape) * np.exp(rng.normal(size=x_shape))
  w = 0.02 * rng.normal(size=w_shape)
  return jnp.asarray(x, x_dtype), jnp.asarray(w, jnp.float32)


@pytest.mark.parametrize(
  'fmt,dtype', [('e4m3', jnp.float32), ('e4m3', jnp.bfloat16), ('e5m2', jnp.bfloat16)]
)
def test_quantize_is_bitwise_the_reference(fmt, dtype):
  x, _ = _inputs(0, (64, 48), (1,), dtype)
  q, scale = fp8.quantize(x, {'e4m3': fp8.E4M3, 'e5m2': fp8.E5M2}[fmt])
  np.testing.assert_array_equal(
    np.asarray(fp8.dequantize(q, scale, jnp.float32), np.float64), _np_qdq(x, fmt)
  )
  assert float(scale) == 2.0 ** np.round(np.log2(float(scale)))  # a power of two
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) > _FP8[fmt][1] / 2  # the range is used


def test_quantize_zero_and_nonfinite():
  q, scale = fp8.quantize(jnp.zeros((4, 4)), fp8.E4M3)
  assert float(scale) == 1.0 and not np.any(np.asarray(q, np.float32))
  q, _ = fp8.quantize(jnp.array([1.0, jnp.inf]), fp8.E4M3)
  assert not np.all(np.isfinite(np.asarray(q, np.float32)))  # an overflow is not clipped away


@pytest.mark.parametrize(
  'equation,x_shape,w_shape',
  [
    ('bld,dnh->blnh', (2, 8, 32), (32, 4, 16)),  # q/k/v
    ('blnh,nhd->bld', (2, 8, 4, 16), (4, 16, 32)),  # o: two contracted axes
    ('bld,df->blf', (2, 8, 32), (32, 48)),  # MLP
  ],
)
def test_forward_matches_numpy_qdq_reference(equation, x_shape, w_shape):
  x, w = _inputs(1, x_shape, w_shape)
  expected = np.einsum(equation, _np_qdq(x, 'e4m3'), _np_qdq(w, 'e4m3'))
  got = fp8.einsum(equation, x, w)
  assert got.dtype == jnp.float32
  # Operands are exact after dequantization: only float32 accumulation rounding remains.
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_close_to_bf16_within_fp8_error():
  x, w = _inputs(2, (4, 64, 256), (256, 384), jnp.bfloat16)
  y_fp8 = fp8.einsum('bld,df->blf', x, w).astype(jnp.float32)
  y_bf16 = jnp.einsum('bld,df->blf', x, w.astype(jnp.bfloat16)).astype(jnp.float32)
  rel = float(jnp.linalg.norm(y_fp8 - y_bf16) / jnp.linalg.norm(y_bf16))
  # e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 per operand); 2^-8 is bf16's own.
  assert 2**-8 < rel < 0.06, rel


def test_gradients_match_reference_vjp():
  equation = 'blnh,nhd->bld'
  x, w = _inputs(3, (2, 8, 4, 16), (4, 16, 32))
  g = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8, 32)) * 1e-3, jnp.float32)
  y, vjp = jax.vjp(lambda x, w: fp8.einsum(equation, x, w), x, w)
  dx, dw = vjp(g)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype and y.shape == g.shape
  g_ref, x_ref, w_ref = _np_qdq(g, 'e5m2'), _np_qdq(x, 'e4m3'), _np_qdq(w, 'e4m3')
  dx_ref = np.einsum('bld,nhd->blnh', g_ref, w_ref)
  dw_ref = np.einsum('blnh,bld->nhd', x_ref, g_ref)
  for got, ref in ((dx, dx_ref), (dw, dw_ref)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # And the same gradients reach a loss through jax.grad.
  dw_grad = jax.grad(lambda w: jnp.sum(fp8.einsum(equation, x, w) * g))(w)
  np.testing.assert_allclose(dw_grad, dw_ref, rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max())


def test_einsum_rejects_non_projection_equations():
  x, w = _inputs(5, (2, 8, 32), (48, 32))
  with pytest.raises(ValueError, match='projections'):
    fp8.einsum('bld,fd->blf', x, w)  # w's contracted axis is not its first
  with pytest.raises(ValueError, match='projections'):
    fp8.einsum('bld,bdf->blf', x, w[None].transpose(0, 2, 1))  # a batch axis
  with pytest.raises(ValueError, match='matmul_dtype'):
    layers.project('bld,df->blf', x, w.T, 'fp16')


def _count_fp8_casts(jaxpr, counts=None):
  """Casts to e4m3 and e5m2 in a jaxpr and its sub-jaxprs (scan bodies, custom VJPs)."""
  counts = counts if counts is not None else {'e4m3': 0, 'e5m2': 0}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'convert_element_type':
      new = jnp.dtype(eqn.params['new_dtype'])
      counts['e4m3'] += new == jnp.float8_e4m3fn
      counts['e5m2'] += new == jnp.float8_e5m2
  for sub in jax.extend.core.subjaxprs(jaxpr):
    _count_fp8_casts(sub, counts)
  return counts


CFG = model_lib.ModelConfig(
  num_layers=2,
  d_model=64,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  ffn_dim=128,
  vocab_size=256,
  seq_len=16,
  dtype='bfloat16',
  scan_layers=False,
)


@pytest.mark.parametrize('qkv_bias', [False, True])
def test_all_seven_projections_and_nothing_else_run_in_fp8(qkv_bias):
  """With q/k/v biases too: they are added after the FP8 dot, never quantised themselves."""
  base = dataclasses.replace(CFG, qkv_bias=qkv_bias, qk_norm=not qkv_bias)
  params = model_lib.init_params(base, jax.random.key(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  for matmul_dtype, per_layer in (('compute', 0), ('fp8', 7)):
    cfg = dataclasses.replace(base, matmul_dtype=matmul_dtype)

    def loss(p, cfg=cfg):
      return model_lib.merge(cfg, p)(tokens).sum()

    fwd = _count_fp8_casts(jax.make_jaxpr(loss)(params).jaxpr)
    # x and w of q, k, v, o, gate, up, down in e4m3; the head and attention core not at all.
    assert fwd == {'e4m3': 2 * per_layer * CFG.num_layers, 'e5m2': 0}
    grad = _count_fp8_casts(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert grad['e5m2'] == per_layer * CFG.num_layers  # one output gradient per projection


@pytest.fixture(scope='module')
def step_losses():
  """Four train steps of the tiny model in bf16, with each matmul dtype, from the same init."""
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import stages  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  losses = {}
  for matmul_dtype in ('compute', 'fp8'):
    config = tiny_test_config(
      **{
        'model.dtype': 'bfloat16',
        'model.matmul_dtype': matmul_dtype,
        'mesh.fsdp': 1,
        'diffusion.varlen_prob': 0.0,
      }
    )
    setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
    step_fn = step_lib.CompiledStep(setup, stages.build(config))
    state = setup.init_state(config.seed)
    rng = np.random.default_rng(0)
    shape = (config.train.global_batch_size, config.model.seq_len + 1)
    values = []
    for _ in range(4):  # rows that count up: a rule the model learns within a few steps
      tokens = 4 + (rng.integers(0, 64, size=(shape[0], 1)) + np.arange(shape[1])) % 64
      state, metrics = step_fn(
        state, {'tokens': jax.device_put(tokens.astype(np.int32), step_fn.batch_sharding)}
      )
      values.append(float(metrics['loss']))
    losses[matmul_dtype] = np.array(values)
  return losses


@pytest.mark.slow  # ~30 s on 2 cores: two train-step compiles
def test_model_loss_with_fp8_close_to_bf16(step_losses):
  bf16, f8 = step_losses['compute'], step_losses['fp8']
  assert f8[-1] < f8[0]  # it trains
  np.testing.assert_allclose(f8, bf16, rtol=2e-2)
  assert np.abs(f8 - bf16).max() > 0  # and the fp8 path really ran


def test_bad_matmul_dtype_is_a_config_error():
  config = tiny_test_config(**{'model.matmul_dtype': 'fp16'})
  with pytest.raises(config_lib.ConfigError, match=r'model\.matmul_dtype=.*compute.*fp8'):
    config_lib.validate(config)
  config_lib.validate(tiny_test_config(**{'model.matmul_dtype': 'fp8'}))


def test_compiler_options_turn_triton_gemms_off_for_fp8_on_gpu(monkeypatch):
  assert fp8.compiler_options('fp8') == {}  # this CPU: nothing to change
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert fp8.compiler_options('fp8') == {'xla_gpu_enable_triton_gemm': False}
  assert fp8.compiler_options('compute') == {}


def test_every_model_program_compiles_with_the_fp8_options(monkeypatch):
  """Train step, sampler and RL scoring all jit through programs.jit_program with the model's
  matmul dtype, and a program built with the GPU options still compiles and runs (here, on the
  CPU)."""
  from dlmjax.diffusion import sampler_programs, sampling_config  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import rollout  # pylint: disable=import-outside-toplevel
  from dlmjax.train import stages  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  seen, real_jit = [], programs.jit_program
  monkeypatch.setattr(
    fp8, 'compiler_options', lambda d: {'xla_gpu_enable_triton_gemm': False} if d == 'fp8' else {}
  )
  monkeypatch.setattr(
    programs, 'jit_program', lambda fn, d, **kw: seen.append(d) or real_jit(fn, d, **kw)
  )
  config = tiny_test_config(**{'model.matmul_dtype': 'fp8', 'mesh.fsdp': 1})
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  step_lib.CompiledStep(setup, stages.build(config))
  rollout.make_score_fn(config, setup.model_config)
  cfg = dataclasses.replace(CFG, matmul_dtype='fp8')
  generate = sampler_programs.make_generate_fn.__wrapped__(  # uncached: this test's own build
    cfg,
    sampling_config.SamplingConfig(gen_length=8, steps=4, block_length=8),
    mask_id=1,
    eos_id=2,
    pad_id=0,
  )
  assert seen == ['fp8', 'fp8', 'fp8']
  out = generate(
    model_lib.init_params(cfg, jax.random.key(0)),
    jnp.full((2, 4), 5, jnp.int32),
    jnp.array([4, 4], jnp.int32),
    jax.random.key(1),
  )
  assert out.shape == (2, 12) and not bool((out == 1).any())  # every mask decoded
