"""The frozen base's projection weights stored in int8 (train.lora.base_dtype=int8).

Symmetric absmax per output channel: q = round(w / s) in [-127, 127] with s = max|w| / 127 over
the weight's input axes, so one scale per output column; the projection dequantises w = q s in
the compute dtype just before its matmul (layers.project). A weight is then one byte per
element plus one float32 scale per output channel (LLM.int8's vector-wise scheme without its
outlier decomposition; the tolerance the tests hold it to is in tests/model/lora_test.py).
The scale sits beside its weight as `<weight>_scale` with the weight's axes (size 1 on the input
axes), so it shards and scans with it.
"""

from __future__ import annotations

import jax.numpy as jnp

KINDS = ('none', 'int8')  # ModelConfig.weight_quant
SCALE_SUFFIX = '_scale'
_INT8_MAX = 127.0


def int8(w, contract_axes: tuple[int, ...]):
  """(int8 values, float32 scale) of a float weight; contract_axes are its input axes."""
  w = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=contract_axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return q, scale


def scale_shape(shape, contract_axes: tuple[int, ...]):
  return tuple(1 if i in contract_axes else n for i, n in enumerate(shape))


def dequantize(q, scale, dtype):
  """q s in dtype (the compute dtype of the matmul that follows)."""
  return q.astype(dtype) * scale.astype(dtype)


def is_scale(name: str) -> bool:
  return name.endswith(SCALE_SUFFIX)


def dequantize_tree(params: dict, dtype=jnp.float32) -> dict:
  """The tree with every int8 weight and its scale replaced by the float weight."""
  out = {}
  for key, value in params.items():
    if isinstance(value, dict):
      out[key] = dequantize_tree(value, dtype)
    elif is_scale(key):
      continue
    elif key + SCALE_SUFFIX in params:
      out[key] = dequantize(value, params[key + SCALE_SUFFIX], dtype)
    else:
      out[key] = value
  return out
