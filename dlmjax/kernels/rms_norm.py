"""RMSNorm, alone or followed by rotate-half RoPE, as one Pallas kernel forward and one backward.

Why a kernel: XLA splits the norm's backward into three reduction fusions that each re-read the
activations (15.8 ms of the 1.7B step on an H200, against ~6 ms for the bytes moved;
docs/benchmarks.md, RMSNorm kernels), and the RoPE after the QK-norm is one more pass each way.
Here each row is read once each way. The forward writes y and the float32 inverse rms. The
backward reads x and dy (and, for the residual stream, the stream's own gradient, so the residual
add costs no pass of its own) and writes dx and one partial sum of d(scale) per program, which XLA
adds up.

Numerics follow `layers.RMSNorm` and `layers.rotary_embedding`: statistics in float32, the
normalised value cast to x's dtype before the gain, RoPE in float32 on the gained value. Rows are
[R, N, H]: R tokens of N heads of H values (N = 1 for the residual stream). The Triton backend
lowers it on GPU; off GPU it runs in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes. A forward program owns `elements` values (a whole number of tokens); a backward
  program loops over `steps` such tiles and writes one d(scale) partial."""

  elements: int
  steps: int
  num_warps: int


# The fastest measured on an H200 at the 1.7B shapes (docs/benchmarks.md, RMSNorm kernels). The
# stream's backward loops over 16 tiles so its d(scale) partials stay 256 rows of D; the QK-norm's
# partials are only H wide, so one tile per program is cheaper than the loop.
STREAM_BLOCKS = Blocks(elements=8192, steps=16, num_warps=8)
ROPE_BLOCKS = Blocks(elements=4096, steps=1, num_warps=4)


def supported(heads: int, head_dim: int, *, rope: bool) -> str | None:
  """Why the GPU kernel cannot take rows of `heads` x `head_dim`, or None if it can.

  Triton tiles are powers of two; RoPE splits the head into two power-of-two halves.
  """
  for what, n in (('heads per shard', heads), ('row width', head_dim)):
    if n & (n - 1):
      return f'the pallas norm kernel needs a power-of-two {what}, got {n}'
  if rope and head_dim < 2:
    return f'rotate-half RoPE needs an even head_dim, got {head_dim}'
  return None


def rms_norm(
  x,
  scale,
  *,
  eps: float,
  cos=None,
  sin=None,
  blocks: Blocks | None = None,
  interpret: bool | None = None,
):
  """scale * x / rms(x) over the last axis, then RoPE by (cos, sin) if given.

  Without RoPE, x is [..., H]. With it, x is [..., N, H] (N heads) and cos / sin are the
  float32 tables [..., H / 2] of each token (`layers.rope_tables`).
  """
  rope = cos is not None
  shape = x.shape
  x_RNH = x.reshape(-1, shape[-2], shape[-1]) if rope else x.reshape(-1, 1, shape[-1])
  if rope:
    cos, sin = (t.reshape(x_RNH.shape[0], -1) for t in (cos, sin))
  blocks = blocks or (ROPE_BLOCKS if rope else STREAM_BLOCKS)
  y = _norm(x_RNH, scale, cos, sin, eps, False, blocks, _interpret(interpret, x_RNH, rope))
  return y.reshape(shape)


def rms_norm_residual(
  x, scale, *, eps: float, blocks: Blocks | None = None, interpret: bool | None = None
):
  """(x, rms_norm(x)) for a pre-norm residual stream x [..., D].

  The caller adds the block's output to the returned x. The backward then gets the stream's
  gradient and the norm's together and adds them in the same pass (XLA fused that add into its
  own norm backward, so a kernel without it would pay one more pass).
  """
  shape = x.shape
  x_RNH = x.reshape(-1, 1, shape[-1])
  x_RNH, y = _norm(
    x_RNH,
    scale,
    None,
    None,
    eps,
    True,
    blocks or STREAM_BLOCKS,
    _interpret(interpret, x_RNH, False),
  )
  return x_RNH.reshape(shape), y.reshape(shape)


def _interpret(interpret, x_RNH, rope):
  """Interpret mode (default: off GPU); a compiled kernel first checks that Triton can tile the
  rows, so a bad shape fails with the fix instead of inside the lowering."""
  interpret = jax.default_backend() != 'gpu' if interpret is None else interpret
  reason = None if interpret else supported(x_RNH.shape[1], x_RNH.shape[2], rope=rope)
  if reason:
    raise ValueError(f'{reason}; use model.norm_backend=auto (or xla) for these shapes')
  return interpret


# ---------------------------------------------------------------------------------------------
# Kernels. A tile is [T tokens, N heads, H] (or its two halves along H, for RoPE).


def _columns(head_dim, rope):
  """Index of the whole row along H, or of its two halves for rotate-half RoPE."""
  if not rope:
    return (slice(None),)
  half = head_dim // 2
  return pl.ds(0, half), pl.ds(half, half)


def _round(v, dtype):
  """v rounded to dtype and back: the values the XLA reference computes with."""
  return v.astype(dtype).astype(jnp.float32)


def _fwd_kernel(*refs, eps, rope):
  if rope:
    x_ref, scale_ref, cos_ref, sin_ref, y_ref, rstd_ref = refs
  else:
    x_ref, scale_ref, y_ref, rstd_ref = refs
  head_dim, dtype = x_ref.shape[-1], y_ref.dtype
  cols = _columns(head_dim, rope)
  x = [x_ref[:, :, c].astype(jnp.float32) for c in cols]
  rstd = lax.rsqrt(sum(jnp.sum(p * p, axis=-1) for p in x) / head_dim + eps)  # [T, N]
  y = [
    _round(
      scale_ref[c].astype(jnp.float32)[None, None, :] * _round(p * rstd[:, :, None], dtype), dtype
    )
    for p, c in zip(x, cols)
  ]
  if rope:
    cos, sin = cos_ref[...][:, None, :], sin_ref[...][:, None, :]
    y = [y[0] * cos - y[1] * sin, y[1] * cos + y[0] * sin]
  for c, p in zip(cols, y):
    y_ref[:, :, c] = p.astype(dtype)
  rstd_ref[...] = rstd


def _bwd_kernel(*refs, rope, residual, tokens, steps):
  refs = list(refs)
  x_ref, scale_ref, rstd_ref = refs[:3]
  cos_ref, sin_ref = refs[3:5] if rope else (None, None)
  refs = refs[5:] if rope else refs[3:]
  gy_ref = refs.pop(0)
  gpass_ref = refs.pop(0) if residual else None
  dx_ref, dscale_ref = refs
  head_dim, dtype = x_ref.shape[-1], x_ref.dtype
  cols = _columns(head_dim, rope)
  scale = [scale_ref[c].astype(jnp.float32)[None, None, :] for c in cols]

  def step(i, acc):
    rows = pl.ds(i * tokens, tokens)
    rstd = rstd_ref[rows, :][:, :, None]
    n = [x_ref[rows, :, c].astype(jnp.float32) * rstd for c in cols]
    g = [gy_ref[rows, :, c].astype(jnp.float32) for c in cols]
    if rope:  # the transpose of the rotation: rotate the gradient back.
      cos, sin = cos_ref[rows, :][:, None, :], sin_ref[rows, :][:, None, :]
      g = [g[0] * cos + g[1] * sin, g[1] * cos - g[0] * sin]
    acc = [
      a + jnp.sum(jnp.sum(gi * _round(ni, dtype), axis=1), axis=0) for a, gi, ni in zip(acc, g, n)
    ]
    dn = [gi * s for gi, s in zip(g, scale)]
    mean = sum(jnp.sum(d * ni, axis=-1) for d, ni in zip(dn, n))[:, :, None] / head_dim
    dx = [rstd * (d - ni * mean) for d, ni in zip(dn, n)]
    for c, d in zip(cols, dx):
      if residual:
        d = d + gpass_ref[rows, :, c].astype(jnp.float32)
      dx_ref[rows, :, c] = d.astype(dx_ref.dtype)
    return acc

  zeros = [jnp.zeros((head_dim // len(cols),), jnp.float32) for _ in cols]
  acc = lax.fori_loop(0, steps, step, zeros)
  for c, a in zip(cols, acc):
    dscale_ref[c] = a


# ---------------------------------------------------------------------------------------------
# pallas_call wiring and the custom VJP.


def _tiling(rows, heads, head_dim, blocks):
  """(tokens per tile, tiles per backward program, padded rows)."""
  tokens = max(1, blocks.elements // (heads * head_dim))
  tokens = min(tokens, 1 << (rows - 1).bit_length())
  tiles = -(-rows // tokens)
  steps = max(1, min(blocks.steps, tiles))
  return tokens, steps, -(-rows // (tokens * steps)) * tokens * steps


def _params(blocks, interpret):
  if interpret:
    return {}
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  return dict(compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=1))


def _pad_rows(t, rows):
  return (
    t
    if t is None or t.shape[0] == rows
    else jnp.pad(t, [(0, rows - t.shape[0])] + [(0, 0)] * (t.ndim - 1))
  )


def _specs(rows, heads, head_dim):
  """BlockSpecs of one program's `rows` tokens of an [R, N, H] array, of its inverse rms [R, N]
  and of its RoPE tables [R, H / 2], and of the whole gain [H]."""
  return (
    pl.BlockSpec((rows, heads, head_dim), lambda i: (i, 0, 0)),
    pl.BlockSpec((rows, heads), lambda i: (i, 0)),
    pl.BlockSpec((rows, head_dim // 2), lambda i: (i, 0)),
    pl.BlockSpec((head_dim,), lambda i: (0,)),
  )


def _forward(x, scale, cos, sin, eps, blocks, interpret):
  rows, heads, head_dim = x.shape
  tokens, _, padded = _tiling(rows, heads, head_dim, blocks)
  rope = cos is not None
  tile, stats, table, gain = _specs(tokens, heads, head_dim)
  x, cos, sin = (_pad_rows(t, padded) for t in (x, cos, sin))
  y, rstd = pl.pallas_call(
    functools.partial(_fwd_kernel, eps=eps, rope=rope),
    grid=(padded // tokens,),
    in_specs=[tile, gain] + [table] * 2 * rope,
    out_specs=[tile, stats],
    out_shape=[
      jax.ShapeDtypeStruct((padded, heads, head_dim), x.dtype),
      jax.ShapeDtypeStruct((padded, heads), jnp.float32),
    ],
    interpret=interpret,
    name='rms_norm_fwd',
    **_params(blocks, interpret),
  )(x, scale, *([cos, sin] if rope else []))
  return y[:rows], rstd[:rows]


def _backward(x, scale, rstd, cos, sin, gy, gpass, blocks, interpret):
  rows, heads, head_dim = x.shape
  tokens, steps, padded = _tiling(rows, heads, head_dim, blocks)
  rope, residual = cos is not None, gpass is not None
  own, stats, table, gain = _specs(tokens * steps, heads, head_dim)
  x, rstd, cos, sin, gy, gpass = (_pad_rows(t, padded) for t in (x, rstd, cos, sin, gy, gpass))
  programs = padded // (tokens * steps)
  dx, partials = pl.pallas_call(
    functools.partial(_bwd_kernel, rope=rope, residual=residual, tokens=tokens, steps=steps),
    grid=(programs,),
    in_specs=[own, gain, stats] + [table] * 2 * rope + [own] * (1 + residual),
    out_specs=[own, pl.BlockSpec((None, head_dim), lambda i: (i, 0))],
    out_shape=[
      jax.ShapeDtypeStruct((padded, heads, head_dim), x.dtype),
      jax.ShapeDtypeStruct((programs, head_dim), jnp.float32),
    ],
    interpret=interpret,
    name='rms_norm_bwd',
    **_params(blocks, interpret),
  )(x, scale, rstd, *([cos, sin] if rope else []), gy, *([gpass] if residual else []))
  return dx[:rows], partials.sum(0).astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _norm(x, scale, cos, sin, eps, residual, blocks, interpret):
  y = _forward(x, scale, cos, sin, eps, blocks, interpret)[0]
  return (x, y) if residual else y


def _norm_fwd(x, scale, cos, sin, eps, residual, blocks, interpret):
  y, rstd = _forward(x, scale, cos, sin, eps, blocks, interpret)
  return ((x, y) if residual else y), (x, scale, rstd, cos, sin)


def _norm_bwd(eps, residual, blocks, interpret, res, g):
  del eps
  x, scale, rstd, cos, sin = res
  gpass, gy = g if residual else (None, g)
  dx, dscale = _backward(
    x,
    scale,
    rstd,
    cos,
    sin,
    gy.astype(x.dtype),
    None if gpass is None else gpass.astype(x.dtype),
    blocks,
    interpret,
  )
  return dx, dscale, None, None  # the RoPE tables are constants of the positions


_norm.defvjp(_norm_fwd, _norm_bwd)
