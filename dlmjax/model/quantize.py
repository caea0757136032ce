"""The frozen base's projection weights in int8 or 4 bits (train.lora.base_dtype int8 | nf4 |
int4); each projection dequantises its weight in the compute dtype just before its matmul
(layers.project), so no full-precision copy of the stack exists.

int8: symmetric absmax per output channel, q = round(w / s) in [-127, 127] with s = max|w| / 127
over the weight's input axes (LLM.int8's vector-wise scheme without its outlier decomposition).
The scale sits beside its weight as `<weight>_scale` with the weight's axes, size 1 on the input
axes.

4 bits (QLoRA's storage): blocks of BLOCK consecutive inputs of one output column along the
weight's last input axis (the grouping bitsandbytes' blocks of 64 have in PyTorch's [out, in]
layout), each scaled by its absmax, every value the nearest of 16 levels: NF4's NormalFloat
levels (QLoRA, Appendix E: the quantiles of N(0, 1) normalised to [-1, 1], with an exact zero) or,
for int4, the evenly spaced (c - 8) / 7. Two 4-bit codes share one uint8 along that axis (byte i
holds values 2i in its low and 2i + 1 in its high nibble), so a weight is half a byte per
element plus one absmax per block in the base's float dtype; its absmax is `<weight>_nf4_scale`
or `<weight>_int4_scale` (the tree names its own format). No double quantisation of the absmax
values: stored in bfloat16 they cost 2 / 64 bytes per weight (0.25 bit), QLoRA's float32 absmax
0.5 bit and its double-quantised one 0.127.

Why not qwix's nf4 (google/qwix 0.1.8): its quantiser takes an argmin over a [elements, 16]
distance array (~100 GiB for one stacked LLaDA-8B MLP weight), its QArray is no leaf of the
pure-dict train state, and the GPU image does not ship it; the nearest-level search here is 15
fused comparisons per element.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlmjax.model import choices

KINDS = choices.WEIGHT_QUANT  # ModelConfig.weight_quant
SCALE_SUFFIXES = {'int8': '_scale', 'nf4': '_nf4_scale', 'int4': '_int4_scale'}
SCALE_SUFFIX = SCALE_SUFFIXES['int8']
BLOCK = 64  # inputs per 4-bit absmax block (QLoRA's and bitsandbytes' default)
_INT8_MAX = 127.0

# QLoRA Appendix E (bitsandbytes' NF4 code book): 7 negative levels, an exact 0, 8 positive.
NF4_LEVELS = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)
INT4_LEVELS = ((np.arange(16) - 8) / 7).astype(np.float32)  # code 0 (-8/7) is never chosen
LEVELS = {'nf4': NF4_LEVELS, 'int4': INT4_LEVELS}


def int8(w, contract_axes: tuple[int, ...]):
  """(int8 values, float32 scale) of a float weight; contract_axes are its input axes."""
  w = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=contract_axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return q, scale


def block_size(n: int) -> int:
  """The absmax block along an input axis of n: BLOCK, or the whole axis when shorter."""
  return min(BLOCK, n)


def check_4bit_axis(name: str, n: int) -> str | None:
  """Why a weight whose last input axis is n cannot be stored in 4 bits, or None."""
  block = block_size(n)
  if n % 2 or n % block:
    return f'{name}: its input axis of {n} is not a multiple of 2 and of the 4-bit block {block}'
  return None


def four_bit(w, axis: int, kind: str):
  """(uint8 codes, float32 absmax) of a float weight in `kind` ('nf4' | 'int4'); `axis` is its
  last input axis: the codes halve it (two per byte), the absmax has one entry per block."""
  w = jnp.asarray(w, jnp.float32)
  n = w.shape[axis]
  block = block_size(n)
  if reason := check_4bit_axis('weight', n):
    raise ValueError(reason)
  blocks = w.reshape(*w.shape[:axis], n // block, block, *w.shape[axis + 1 :])
  amax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
  normalised = blocks / jnp.where(amax > 0, amax, 1.0)
  levels = LEVELS[kind]
  codes = jnp.zeros(normalised.shape, jnp.uint8)
  for middle in (levels[1:] + levels[:-1]) / 2:  # the nearest level: count the midpoints below
    codes = codes + (normalised > middle).astype(jnp.uint8)
  codes = codes.reshape(*w.shape[:axis], n // 2, 2, *w.shape[axis + 1 :])
  low = jnp.take(codes, 0, axis=axis + 1)
  high = jnp.take(codes, 1, axis=axis + 1)
  return low | (high << 4), jnp.squeeze(amax, axis + 1)


def dequantize_4bit(packed, amax, axis: int, kind: str, dtype):
  """The float weight (dtype) of four_bit's (codes, absmax) along input axis `axis`."""
  low, high = packed & 0xF, packed >> 4
  codes = jnp.stack([low, high], axis=axis + 1)
  n = 2 * packed.shape[axis]
  codes = codes.reshape(*packed.shape[:axis], n, *packed.shape[axis + 1 :])
  values = jnp.asarray(LEVELS[kind], dtype)[codes.astype(jnp.int32)]
  blocks = amax.shape[axis]
  values = values.reshape(*packed.shape[:axis], blocks, n // blocks, *packed.shape[axis + 1 :])
  values = values * jnp.expand_dims(amax.astype(dtype), axis + 1)
  return values.reshape(codes.shape)


def scale_shape(shape, contract_axes: tuple[int, ...]):
  return tuple(1 if i in contract_axes else n for i, n in enumerate(shape))


def dequantize(q, scale, dtype, kind: str = 'int8', axis: int = 0):
  """The float weight in dtype (the compute dtype of the matmul that follows): q s for int8;
  for 4 bits, `axis` is the weight's last input axis."""
  if kind == 'int8':
    return q.astype(dtype) * scale.astype(dtype)
  return dequantize_4bit(q, scale, axis, kind, dtype)


def scale_kind(name: str) -> str | None:
  """The format whose scale a parameter name is ('int8' | 'nf4' | 'int4'), or None."""
  for kind in ('nf4', 'int4', 'int8'):  # the longer suffixes first: both end in '_scale'
    if name.endswith(SCALE_SUFFIXES[kind]):
      return kind
  return None


def is_scale(name: str) -> bool:
  return scale_kind(name) is not None


def weight_scale(params: dict, name: str):
  """(scale array, kind) of a weight in a tree level, or (None, None) when it is float."""
  for kind, suffix in SCALE_SUFFIXES.items():
    if name + suffix in params:
      return params[name + suffix], kind
  return None, None


def last_input_axis(name: str) -> int:
  """The last input axis of a stacked projection weight [layers, *in, *out]: o_proj's inputs
  are heads and head_dim, every other one's is its first axis after the layers."""
  return 2 if name == 'o_proj' else 1


def dequantize_tree(params: dict, dtype=jnp.float32) -> dict:
  """The tree with every quantised weight and its scale replaced by the float weight (a frozen
  base's projections are stacked: one layers axis in front)."""
  out = {}
  for key, value in params.items():
    if isinstance(value, dict):
      out[key] = dequantize_tree(value, dtype)
      continue
    if is_scale(key):
      continue
    scale, kind = weight_scale(params, key)
    if scale is None:
      out[key] = value
    else:
      out[key] = dequantize(value, scale, dtype, kind, last_input_axis(key))
  return out


def bytes_per_weight(kind: str, float_bytes: int, n_in: int) -> float:
  """Storage bytes per element of a projection weight: int8 shares one scale over its n_in
  inputs, 4 bits one absmax per block of its last input axis (n_in: that axis's width)."""
  if kind == 'int8':
    return 1 + float_bytes / n_in
  if kind in LEVELS:
    return 0.5 + float_bytes / block_size(n_in)
  return float(float_bytes)
