"""Building blocks of the transformer: parameters with logical axes, projections, RMSNorm, RoPE,
SwiGLU MLP.

Axis letters: B batch, L length, D d_model, N query heads, K kv heads, H head dim, F ffn, V vocab.
Every parameter may carry a leading stacked-layer axis (`num_stacked`), so one Block module holds
all layers and the transformer scans over it.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dlmjax import config as config_lib
from dlmjax.kernels import rms_norm as rms_norm_kernel
from dlmjax.model import choices, fp8, lora, quantize
from dlmjax.parallel import rules

COMPUTE_DTYPES = choices.COMPUTE_DTYPES  # model.dtype
MATMUL_DTYPES = choices.MATMUL_DTYPES  # model.matmul_dtype
NORM_BACKENDS = choices.NORM_BACKENDS  # model.norm_backend


def stacked_param(
  rngs: nnx.Rngs, shape, axes, *, std=None, num_stacked=0, zeros=False
) -> nnx.Param:
  """A float32 parameter, N(0, std), ones when std is None or zeros (drawing no random numbers),
  with its logical axis names."""
  if num_stacked:
    shape, axes = (num_stacked, *shape), (rules.LAYERS, *axes)
  if zeros:
    value = jnp.zeros(shape, jnp.float32)
  elif std is None:
    value = jnp.ones(shape, jnp.float32)
  else:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value, axes=tuple(axes))


def project(equation: str, x, w, matmul_dtype: str, *, scale=None, quant='int8', adapter=None):
  """A projection einsum of activations x and a float32 parameter w, the one path every
  projection takes: operands in x's (compute) dtype, or FP8 (fp8.py) for matmul_dtype='fp8'.

  scale: w is quantised in format `quant` (int8 | nf4 | int4, model/quantize.py) with this
  scale, dequantised here. adapter: (A, B, alpha / r[, dropout]) adds (alpha / r) (x A) B in the
  compute dtype (model/lora.py), whatever matmul_dtype the base matmul runs in; dropout, (key,
  rate) or None, drops elements of the adapter's input x only (PEFT's lora_dropout).
  """
  if scale is not None:
    dtype = x.dtype if matmul_dtype == 'compute' else jnp.float32
    w = quantize.dequantize(w, scale, dtype, quant, _last_contracted_axis(equation))
  if matmul_dtype == 'fp8':
    y = fp8.einsum(equation, x, w)
  elif matmul_dtype != 'compute':
    raise ValueError(f'matmul_dtype={matmul_dtype!r} is not one of {MATMUL_DTYPES}.')
  else:
    y = jnp.einsum(equation, x, w.astype(x.dtype))
  return y if adapter is None else add_adapter(equation, x, y, adapter)


def add_adapter(equation: str, x, y, adapter):
  """y plus the LoRA adapter's (alpha / r) (x A) B of project(); adapter as project() takes it."""
  a, b, factor, *dropout = adapter
  down_eq, up_eq = lora.adapter_equations(equation)
  x_in = lora.drop(x, *dropout[0]) if dropout and dropout[0] is not None else x
  xa = jnp.einsum(down_eq, x_in, a.astype(x.dtype))
  return y + (jnp.einsum(up_eq, xa, b.astype(x.dtype)) * factor).astype(y.dtype)


def project_fused(
  module, fused: str, parts, axis: int, equation: str, x, matmul_dtype: str, lora_spec
):
  """The outputs of the projections `parts` ((name, width) pairs, in order) of x from one matmul
  over their weights concatenated along output axis `axis` (module.<fused>, as
  fuse_projections builds it), split again there; each part then adds its own adapter, if any,
  as project() adds it. The values of one project() per part, up to the matmul's grouping
  (docs/benchmarks.md, Sampler, Fused projections)."""
  operands = projection_operands(module, fused, None)
  y = project(equation, x, getattr(module, fused).value, matmul_dtype, **operands)
  widths = [width for _, width in parts]
  outs = jnp.split(y, list(itertools.accumulate(widths[:-1])), axis=axis)
  adapted = []
  for (name, _), out in zip(parts, outs):
    adapter = lora_adapter(module, name, lora_spec)
    adapted.append(out if adapter is None else add_adapter(equation, x, out, adapter))
  return adapted


def fuse_projections(tree: dict, parts, fused: str, axis: int) -> dict:
  """A module's parameter dict with the weights `parts` (names) and their quantisation scales
  concatenated along `axis` (their outputs' axis) into `fused` and its scales; everything else,
  the parts' adapters included, kept as it is. Every scale layout (model/quantize.py) keeps the
  weight's output axes, so codes and scales concatenate alike."""
  out = {k: v for k, v in tree.items() if k not in parts}
  out[fused] = jnp.concatenate([tree[name] for name in parts], axis=axis)
  for suffix in quantize.SCALE_SUFFIXES.values():
    if parts[0] + suffix in tree:
      out[fused + suffix] = jnp.concatenate([tree[n + suffix] for n in parts], axis=axis)
      for name in parts:
        out.pop(name + suffix)
  return out


def _last_contracted_axis(equation: str) -> int:
  """The weight's last input axis in a projection einsum 'x,w->y' (4-bit blocks run along it)."""
  inputs, out = equation.split('->')
  lhs, rhs = inputs.split(',')
  return max(i for i, c in enumerate(rhs) if c in lhs and c not in out)


def add_projection(
  module, name, rngs, shape, axes, *, std, num_stacked, contract_ndim, lora_spec, quant='none'
):
  """Sets module.<name> (the weight [layers?, *in, *out], N(0, std)), its scale when quant is
  int8 / nf4 / int4 and its LoRA A and B when lora_spec adapts it; `projection_operands` reads
  them."""
  weight = stacked_param(rngs, shape, axes, std=std, num_stacked=num_stacked)
  full_axes = weight.get_metadata()['axes']
  lead = 1 if num_stacked else 0
  if quant == 'int8':
    q, scale = quantize.int8(weight.value, tuple(range(lead, lead + contract_ndim)))
  elif quant in quantize.LEVELS:
    q, scale = quantize.four_bit(weight.value, lead + contract_ndim - 1, quant)
  elif quant != 'none':
    raise ValueError(f'weight quantization {quant!r} is not one of {quantize.KINDS}.')
  if quant != 'none':
    weight = nnx.Param(q, axes=full_axes)
    suffix = quantize.SCALE_SUFFIXES[quant]
    setattr(module, name + suffix, nnx.Param(scale, axes=full_axes))
  setattr(module, name, weight)
  add_adapter_params(module, name, rngs, shape, axes, num_stacked, contract_ndim, lora_spec)


def add_adapter_params(module, name, rngs, shape, axes, num_stacked, contract_ndim, lora_spec):
  """Sets module.<name>_lora_a and _lora_b, the adapter of a weight of this shape and axes (no
  layers axis), when lora_spec adapts `name`."""
  if lora_spec is None or not lora_spec.adapts(name):
    return
  if num_stacked:
    shape, axes = (num_stacked, *shape), (rules.LAYERS, *axes)
  (a_shape, a_axes), (b_shape, b_axes) = lora.adapter_shapes(
    shape, axes, contract_ndim, lora_spec.rank, num_stacked
  )
  a = lora.init_a(rngs.params(), a_shape, contract_ndim)
  setattr(module, name + lora.A_SUFFIX, nnx.Param(a, axes=a_axes))
  setattr(module, name + lora.B_SUFFIX, nnx.Param(jnp.zeros(b_shape, jnp.float32), axes=b_axes))


def projection_operands(module, name, lora_spec) -> dict:
  """project()'s keyword arguments for module.<name>: its scale and format when quantised, its
  adapter, if any."""
  kwargs = {}
  for quant, suffix in quantize.SCALE_SUFFIXES.items():
    scale = getattr(module, name + suffix, None)
    if scale is not None:
      kwargs['scale'], kwargs['quant'] = scale.value, quant
  adapter = lora_adapter(module, name, lora_spec)
  if adapter is not None:
    kwargs['adapter'] = adapter
  return kwargs


def lora_adapter(module, name, lora_spec):
  """project()'s adapter operand of module.<name>, or None when lora_spec does not adapt it."""
  if lora_spec is None or not lora_spec.adapts(name):
    return None
  a = getattr(module, name + lora.A_SUFFIX).value
  b = getattr(module, name + lora.B_SUFFIX).value
  return (a, b, lora_spec.factor, lora.projection_dropout(name))


class RMSNorm(nnx.Module):
  """w * normalise(x) computed in float32, cast back before the gain (as HF Qwen3 / MegaDLMs).

  backend (model.norm_backend): 'xla' writes the formula and lets XLA fuse it; 'pallas' runs
  dlmjax/kernels/rms_norm.py (one pass each way; interpret mode off GPU); 'auto' takes the kernel
  on GPU where it applies and XLA elsewhere.
  """

  def __init__(
    self, dim: int, *, eps: float, rngs: nnx.Rngs, num_stacked: int = 0, backend: str = 'xla'
  ):
    if backend not in NORM_BACKENDS:
      raise ValueError(f'norm backend {backend!r} is not one of {NORM_BACKENDS}')
    self.eps = eps
    self.backend = backend
    self.scale = stacked_param(rngs, (dim,), (rules.NORM,), num_stacked=num_stacked)

  def __call__(self, x_BLD):
    if self._kernel(x_BLD.shape[-1], rope=False):
      return rules.per_shard(
        functools.partial(rms_norm_kernel.rms_norm, eps=self.eps),
        (x_BLD, self.scale.value),
        (_STREAM, ()),
        _STREAM,
      )
    return self._formula(x_BLD)

  def _formula(self, x):
    return rms_norm(x, self.scale.value, self.eps)

  def with_residual(self, x_BLD):
    """(x, self(x)) for a pre-norm residual stream: the kernel's backward then adds the stream's
    own gradient in the pass that computes the norm's."""
    if not self._kernel(x_BLD.shape[-1], rope=False):
      return x_BLD, self(x_BLD)
    return rules.per_shard(
      functools.partial(rms_norm_kernel.rms_norm_residual, eps=self.eps),
      (x_BLD, self.scale.value),
      (_STREAM, ()),
      [_STREAM, _STREAM],
    )

  def with_rope(self, x_BLNH, positions_BL, theta: float, scaling: str = '', rope_dim: int = 0):
    """rotary_embedding(self(x)) over heads: the QK-norm and RoPE, one kernel pass each way (a
    partial RoPE, rope_dim < the head size, runs the formula)."""
    partial = 0 < rope_dim < x_BLNH.shape[-1]
    if partial or not self._kernel(x_BLNH.shape[-1], rope=True, heads=x_BLNH.shape[-2]):
      return rotary_embedding(self._formula(x_BLNH), positions_BL, theta, scaling, rope_dim)
    cos_BLh, sin_BLh = rope_tables(positions_BL, x_BLNH.shape[-1], theta, scaling)
    heads = (rules.BATCH, rules.LENGTH, rules.ACT_HEADS, None)
    tables = (rules.BATCH, rules.LENGTH, None)

    def norm(x, scale, cos, sin):
      return rms_norm_kernel.rms_norm(x, scale, eps=self.eps, cos=cos, sin=sin)

    return rules.per_shard(
      norm, (x_BLNH, self.scale.value, cos_BLh, sin_BLh), (heads, (), tables, tables), heads
    )

  def _kernel(self, width, *, rope, heads=1) -> bool:
    if self.backend == 'pallas':
      return True
    if self.backend == 'auto' and jax.default_backend() == 'gpu':
      mesh = rules.current_mesh()
      tensor = 1 if mesh is None or heads == 1 else mesh.shape.get('tensor', 1)
      return rms_norm_kernel.supported(max(1, heads // tensor), width, rope=rope) is None
    return False


_STREAM = (rules.BATCH, rules.LENGTH, rules.ACT_EMBED)


def rms_norm(x, scale, eps: float):
  """The formula over the last axis, as XLA is left to fuse it (the kernel's reference)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = jnp.expand_dims(scale, tuple(range(x.ndim - scale.ndim)))  # [D] -> [1, ..., D]
  return scale.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: str = ''):
  """[H / 2] float32 rotary frequencies theta^(-2i / H), scaled as model.rope_scaling says.

  linear divides every frequency by `factor`. llama3 (Llama-3.1's, as transformers'
  `_compute_llama3_parameters`): wavelengths 2 pi / f longer than original_max_position_embeddings
  / low_freq_factor are divided by `factor`, those shorter than ... / high_freq_factor kept, and
  the band between interpolates with s = (original / wavelength - low) / (high - low):
  f' = (1 - s) f / factor + s f. Neither type rescales the attention logits.
  """
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  parsed = config_lib.parse_rope_scaling(scaling)
  if parsed is None:
    return inv_freq
  kind, f = parsed
  if kind == 'linear':
    return inv_freq / f['factor']
  original, factor = f['original_max_position_embeddings'], f['factor']
  low, high = f['low_freq_factor'], f['high_freq_factor']
  wavelength = 2 * math.pi / inv_freq
  smooth = (original / wavelength - low) / (high - low)
  interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = jnp.where(wavelength > original / low, inv_freq / factor, interpolated)
  return jnp.where(wavelength < original / high, inv_freq, scaled)


def rope_tables(positions_BL, head_dim: int, theta: float, scaling: str = ''):
  """cos and sin [B, L, H / 2] (float32) of each position's rotary angles."""
  inv_freq = rope_inv_freq(head_dim, theta, scaling)
  angles_BLh = positions_BL.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  return jnp.cos(angles_BLh), jnp.sin(angles_BLh)


def rotary_embedding(x_BLNH, positions_BL, theta: float, scaling: str = '', rope_dim: int = 0):
  """Rotate-half RoPE (non-interleaved), as Megatron with rotary fraction 1 and HF Qwen3.

  rope_dim < the head size (model.rope_fraction, transformers' partial_rotary_factor): the first
  rope_dim dims of each head rotate, with the frequencies of a rope_dim-wide head, and the rest
  pass through unchanged (LLaDA2's / Ling's apply_rotary_pos_emb)."""
  if 0 < rope_dim < x_BLNH.shape[-1]:
    rotated = rotary_embedding(x_BLNH[..., :rope_dim], positions_BL, theta, scaling)
    return jnp.concatenate([rotated, x_BLNH[..., rope_dim:]], axis=-1)
  cos_BLh, sin_BLh = rope_tables(positions_BL, x_BLNH.shape[-1], theta, scaling)
  cos, sin = (jnp.concatenate([t, t], axis=-1)[:, :, None, :] for t in (cos_BLh, sin_BLh))
  x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x_BLNH.astype(jnp.float32) * cos + rotated * sin).astype(x_BLNH.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)).

  fused (ModelConfig.fused_projections, the inference layout): gate and up are one weight
  `gate_up_proj` [D, 2F] (MLP.fuse builds it from the trained pair), one matmul then split; their
  adapters, if any, stay their own."""

  FUSED = ('gate_up_proj', ('gate_proj', 'up_proj'), -1)  # (name, parts, output axis)

  def __init__(
    self,
    d_model: int,
    ffn_dim: int,
    *,
    std: float,
    out_std: float,
    rngs: nnx.Rngs,
    num_stacked: int = 0,
    matmul_dtype: str = 'compute',
    lora_spec: lora.Spec | None = None,
    weight_quant: str = 'none',
    fused: bool = False,
  ):
    self.matmul_dtype = matmul_dtype
    self.lora_spec = lora_spec
    self.ffn_dim = ffn_dim
    self.fused = fused
    kw = dict(num_stacked=num_stacked, contract_ndim=1, lora_spec=lora_spec, quant=weight_quant)
    in_axes = (rules.EMBED, rules.MLP)
    if fused:
      add_projection(
        self,
        'gate_up_proj',
        rngs,
        (d_model, 2 * ffn_dim),
        in_axes,
        std=std,
        **dict(kw, lora_spec=None),
      )
      for name in self.FUSED[1]:
        add_adapter_params(self, name, rngs, (d_model, ffn_dim), in_axes, num_stacked, 1, lora_spec)
    else:
      for name in ('gate_proj', 'up_proj'):
        add_projection(self, name, rngs, (d_model, ffn_dim), in_axes, std=std, **kw)
    add_projection(
      self, 'down_proj', rngs, (ffn_dim, d_model), (rules.MLP, rules.EMBED), std=out_std, **kw
    )

  @classmethod
  def fuse(cls, tree: dict) -> dict:
    """The module's trained parameter dict in the fused layout (fuse_projections)."""
    fused, parts, axis = cls.FUSED
    return fuse_projections(tree, parts, fused, axis)

  def _project(self, name, equation, x):
    w = getattr(self, name).value
    extra = projection_operands(self, name, self.lora_spec)
    return project(equation, x, w, self.matmul_dtype, **extra)

  def __call__(self, x_BLD):
    if self.fused:
      fused, parts, axis = self.FUSED
      widths = tuple((name, self.ffn_dim) for name in parts)
      gate_BLF, up_BLF = project_fused(
        self, fused, widths, axis, 'bld,df->blf', x_BLD, self.matmul_dtype, self.lora_spec
      )
    else:
      gate_BLF = self._project('gate_proj', 'bld,df->blf', x_BLD)
      up_BLF = self._project('up_proj', 'bld,df->blf', x_BLD)
    gate_BLF = checkpoint_name(gate_BLF, 'mlp_gate')
    up_BLF = checkpoint_name(up_BLF, 'mlp_up')
    h_BLF = rules.constrain(
      jax.nn.silu(gate_BLF) * up_BLF, (rules.BATCH, rules.LENGTH, rules.ACT_MLP)
    )
    h_BLF = checkpoint_name(h_BLF, 'mlp_hidden')
    out_BLD = self._project('down_proj', 'blf,fd->bld', h_BLF)
    return checkpoint_name(out_BLD, 'mlp_out')
