"""FP8 projection matmuls (Hopper): e4m3 forward, e5m2 gradients, per-tensor current scaling.

The FP8 recipe is one decision, so it is written once here: which formats, which scales, which
GEMMs run in FP8 and how they accumulate. The projections reach it through `layers.project`.

Nothing here calls cuBLAS. XLA's GPU GEMM rewriter turns
`dot(convert(x_f8) * broadcast(s_x), convert(w_f8) * broadcast(s_w))` into one cuBLASLt FP8 GEMM
with s_x and s_w as its operand scales (openxla RFC 22; NVIDIA JAX-Toolbox's native FP8 guide), so
the code writes exactly that graph: quantize, dequantize, dot. Off GPU the same graph is an exact
emulation (quantize-dequantize, then an ordinary dot), which is what the CPU tests check.

The recipe, Transformer Engine's with per-tensor scales:
- forward y = x w with x and w in e4m3 (3 mantissa bits, max 448) and fast accumulation
  (Precision.DEFAULT: XLA turns cuBLASLt's fast FP8 accumulation on only at DEFAULT);
- backward (a custom VJP, so both gradient GEMMs are FP8 too): the output gradient g in e5m2
  (range before precision, max 57344); dgrad = g w^T and wgrad = x^T g against the saved e4m3
  operands, with full accumulation (Precision.HIGHEST), as TE's split accumulator;
- current scaling, s = 2^ceil(log2(amax / max)) from the tensor at hand, not delayed scaling (an
  amax history of past steps): no extra state in the parameters, optimizer or checkpoints and no
  stale scale after a spike, for one more reduction pass over each tensor. Powers of two make the
  quantization an exact exponent shift (the cast is the only rounding) and the scale exact in
  bf16, where the dequantize multiply runs; they leave at most one of e4m3's binades unused;
- the residuals are the fp8 tensors and their scales: one byte per element, half of bf16's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn  # forward operands: activations and weights.
E5M2 = jnp.float8_e5m2  # backward: the output gradient.


def scale_for(x, fp8_dtype) -> jax.Array:
  """The float32 power of two s with max|x| / s <= the largest finite value of fp8_dtype.

  An all-zero x gets 1; a non-finite amax gives a non-finite scale, so an overflow upstream
  still reaches the loss (and the step's non-finite guard) instead of being clipped away.
  """
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.exp2(jnp.ceil(jnp.log2(amax / float(jnp.finfo(fp8_dtype).max))))
  return jnp.where(amax > 0, scale, jnp.ones_like(scale))


def quantize(x, fp8_dtype):
  """(x / s rounded to fp8_dtype, s): saturating at the format's largest finite value."""
  scale = scale_for(x, fp8_dtype)
  fp8_max = float(jnp.finfo(fp8_dtype).max)
  scaled = x / scale.astype(x.dtype)  # exact: s is a power of two
  return jnp.clip(scaled, -fp8_max, fp8_max).astype(fp8_dtype), scale


def dequantize(q, scale, dtype):
  """convert(q) * s in dtype: the half of the pattern that XLA folds into the FP8 GEMM."""
  return q.astype(dtype) * scale.astype(dtype)


def _contraction(x_ndim: int, contract: int):
  """dot_general numbers: x's last `contract` axes against w's first ones, no batch axes."""
  return (tuple(range(x_ndim - contract, x_ndim)), tuple(range(contract))), ((), ())


def _forward(x, w, contract):
  x_q, x_scale = quantize(x, E4M3)
  w_q, w_scale = quantize(w, E4M3)
  y = lax.dot_general(
    dequantize(x_q, x_scale, x.dtype),
    dequantize(w_q, w_scale, x.dtype),
    _contraction(x.ndim, contract),
    precision=lax.Precision.DEFAULT,
  )
  return y, (x_q, x_scale, w_q, w_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(x, w, contract, w_dtype):
  del w_dtype
  return _forward(x, w, contract)[0]


def _fp8_dot_fwd(x, w, contract, w_dtype):
  del w_dtype
  return _forward(x, w, contract)


def _fp8_dot_bwd(contract, w_dtype, residuals, g):
  x_q, x_scale, w_q, w_scale = residuals
  dtype = g.dtype  # the compute dtype: y's, hence x's
  g_q, g_scale = quantize(g, E5M2)
  g_deq = dequantize(g_q, g_scale, dtype)
  x_deq, w_deq = dequantize(x_q, x_scale, dtype), dequantize(w_q, w_scale, dtype)
  x_free = x_q.ndim - contract
  # dgrad: g's w-side axes against w's free axes -> [x's free axes..., w's contracted axes].
  dx = lax.dot_general(
    g_deq,
    w_deq,
    ((tuple(range(x_free, g.ndim)), tuple(range(contract, w_q.ndim))), ((), ())),
    precision=lax.Precision.HIGHEST,
  )
  # wgrad: x's free axes against g's x-side axes -> [x's contracted axes..., w's free axes].
  dw = lax.dot_general(
    x_deq,
    g_deq,
    ((tuple(range(x_free)), tuple(range(x_free))), ((), ())),
    precision=lax.Precision.HIGHEST,
  )
  return dx.astype(dtype), dw.astype(w_dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def dot(x, w, contract: int = 1):
  """x's last `contract` axes times w's first ones, in FP8, output in x's dtype.

  w may be the float32 parameter itself: it is quantized from float32 and its gradient is
  returned in float32, as `w.astype(x.dtype)` would give in the plain path.
  """
  if x.shape[x.ndim - contract :] != w.shape[:contract]:
    raise ValueError(
      f'fp8.dot: x {x.shape} and w {w.shape} do not share {contract} contracted '
      "axes (x's last, w's first)."
    )
  return _fp8_dot(x, w, contract, jnp.dtype(w.dtype))


def compiler_options(matmul_dtype: str) -> dict:
  """XLA options for a jitted program with these matmuls: with FP8 on GPU, no Triton GEMMs.

  Measured on an H200 (docs/benchmarks.md, FP8 matmuls): with XLA's Triton GEMM emitter on, it
  claimed the dequantize + dot pattern before the FP8 rewrite, so the 1.7B step ran none of its
  588 projection GEMMs in FP8 (bf16 GEMMs on dequantized operands, 0.92x bf16's speed); with it
  off, all 588 were cuBLASLt FP8 GEMMs, and bf16 alone runs as fast either way.
  """
  if matmul_dtype == 'fp8' and jax.default_backend() == 'gpu':
    return {'xla_gpu_enable_triton_gemm': False}
  return {}


def einsum(equation: str, x, w):
  """jnp.einsum(equation, x, w) in FP8, for projections: x's last axes contract with w's first.

  That is the form of every projection here ('bld,dnh->blnh', 'blnh,nhd->bld'); other equations
  raise rather than fall back silently to another precision.
  """
  inputs, out = equation.replace(' ', '').split('->')
  lhs, rhs = inputs.split(',')
  contract = len(set(lhs) & set(rhs))
  if (
    not contract
    or lhs[len(lhs) - contract :] != rhs[:contract]
    or out != lhs[: len(lhs) - contract] + rhs[contract:]
  ):
    raise ValueError(
      f'fp8.einsum takes projections whose contracted axes end x and begin w, in '
      f'order, with no batch axes (e.g. "bld,dnh->blnh"); got {equation!r}.'
    )
  return dot(x, w, contract)
