"""Building blocks of the transformer: parameters with logical axes, projections, RMSNorm, RoPE,
SwiGLU MLP.

Axis letters: B batch, L length, D d_model, N query heads, K kv heads, H head dim, F ffn, V vocab.
Every parameter may carry a leading stacked-layer axis (`num_stacked`), so one Block module holds
all layers and the transformer scans over it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dlmjax.model import fp8
from dlmjax.parallel import rules

MATMUL_DTYPES = ('compute', 'fp8')  # model.matmul_dtype: the projections' operand precision.


def stacked_param(rngs: nnx.Rngs, shape, axes, *, std=None, num_stacked=0) -> nnx.Param:
  """A float32 parameter, N(0, std) or ones when std is None, with its logical axis names."""
  if num_stacked:
    shape, axes = (num_stacked, *shape), (rules.LAYERS, *axes)
  if std is None:
    value = jnp.ones(shape, jnp.float32)
  else:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value, axes=tuple(axes))


def project(equation: str, x, w, matmul_dtype: str):
  """A projection einsum of activations x and a float32 parameter w, the one path every
  projection takes: operands in x's (compute) dtype, or FP8 (fp8.py) for matmul_dtype='fp8'."""
  if matmul_dtype == 'fp8':
    return fp8.einsum(equation, x, w)
  if matmul_dtype != 'compute':
    raise ValueError(f'matmul_dtype={matmul_dtype!r} is not one of {MATMUL_DTYPES}.')
  return jnp.einsum(equation, x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """w * normalise(x) computed in float32, cast back before the gain (as HF Qwen3 / MegaDLMs)."""

  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, num_stacked: int = 0):
    self.eps = eps
    self.scale = stacked_param(rngs, (dim,), (rules.NORM,), num_stacked=num_stacked)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.value.astype(x.dtype) * normed.astype(x.dtype)


def rotary_embedding(x_BLNH, positions_BL, theta: float):
  """Rotate-half RoPE (non-interleaved), as Megatron with rotary fraction 1 and HF Qwen3."""
  head_dim = x_BLNH.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles_BLh = positions_BL.astype(jnp.float32)[..., None] * inv_freq
  angles_BLH = jnp.concatenate([angles_BLh, angles_BLh], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_BLH), jnp.sin(angles_BLH)
  x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x_BLNH.astype(jnp.float32) * cos + rotated * sin).astype(x_BLNH.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, d_model: int, ffn_dim: int, *, std: float, out_std: float,
               rngs: nnx.Rngs, num_stacked: int = 0, matmul_dtype: str = 'compute'):
    kw = dict(num_stacked=num_stacked)
    self.matmul_dtype = matmul_dtype
    in_axes = (rules.EMBED, rules.MLP)
    self.gate_proj = stacked_param(rngs, (d_model, ffn_dim), in_axes, std=std, **kw)
    self.up_proj = stacked_param(rngs, (d_model, ffn_dim), in_axes, std=std, **kw)
    self.down_proj = stacked_param(rngs, (ffn_dim, d_model), (rules.MLP, rules.EMBED),
                                   std=out_std, **kw)

  def __call__(self, x_BLD):
    mm = self.matmul_dtype
    gate_BLF = checkpoint_name(project('bld,df->blf', x_BLD, self.gate_proj.value, mm), 'mlp_gate')
    up_BLF = checkpoint_name(project('bld,df->blf', x_BLD, self.up_proj.value, mm), 'mlp_up')
    h_BLF = rules.constrain(jax.nn.silu(gate_BLF) * up_BLF,
                            (rules.BATCH, rules.LENGTH, rules.ACT_MLP))
    h_BLF = checkpoint_name(h_BLF, 'mlp_hidden')
    out_BLD = project('blf,fd->bld', h_BLF, self.down_proj.value, mm)
    return checkpoint_name(out_BLD, 'mlp_out')
