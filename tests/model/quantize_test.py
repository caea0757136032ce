"""The frozen base's 4-bit storage (model/quantize.py): NF4 and int4 codes against hand-written
level tables, the per-weight quantisation bound, a forward near the float base, and the bytes
the memory estimate counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.model import lora, quantize

# QLoRA, Appendix E: the NF4 levels, written out here independently of the module's copy.
_NF4 = [
  -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
  -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
  0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
  0.7229568362236023, 1.0,
]  # fmt: skip
_INT4 = [(c - 8) / 7 for c in range(16)]


def _by_hand(w, levels, block):
  """Per block of `block` along axis 1: absmax, the nearest level of w / absmax, level x absmax;
  also the codes."""
  levels = np.asarray(levels, np.float64)
  layers, n, out = w.shape
  blocks = w.reshape(layers, n // block, block, out).astype(np.float64)
  amax = np.abs(blocks).max(axis=2, keepdims=True)
  codes = np.abs(blocks[..., None] / amax[..., None] - levels).argmin(-1)
  return (levels[codes] * amax).reshape(w.shape), codes.reshape(w.shape)


@pytest.mark.parametrize('kind, levels', [('nf4', _NF4), ('int4', _INT4)])
def test_4bit_codes_and_dequantised_weights_match_the_hand_written_table(kind, levels):
  w = np.asarray(jax.random.normal(jax.random.key(0), (2, 128, 3)), np.float32)
  packed, amax = quantize.four_bit(w, 1, kind)
  assert packed.dtype == jnp.uint8 and packed.shape == (2, 64, 3) and amax.shape == (2, 2, 3)
  want, codes = _by_hand(w, levels, 64)
  packed = np.asarray(packed)
  np.testing.assert_array_equal(packed & 0xF, codes[:, 0::2])  # element 2i: the low nibble
  np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
  got = quantize.dequantize(jnp.asarray(packed), amax, jnp.float32, kind, axis=1)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  # The bound: no weight is further from its value than half the widest gap between levels.
  half_gap = np.max(np.diff(levels)) / 2
  bound = half_gap * np.repeat(np.abs(w.reshape(2, 2, 64, 3)).max(2), 64, axis=1)
  assert np.all(np.abs(np.asarray(got) - w) <= bound * (1 + 1e-6))


def test_a_4bit_base_computes_near_the_float_base_and_counts_its_bytes():
  """Logits of the NF4 base against the float32 model within 15% of the logits' RMS; on the
  normal weights NF4's levels (normal quantiles) err less than int4's even ones, and both more
  than int8. Each tree holds half a byte per 4-bit weight plus a bf16 absmax per 64 (or per
  head_dim) inputs, exactly what lora.base_bytes (summary, the memory check) counts."""
  cfg = model_lib.ModelConfig(
    num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128,
    vocab_size=64, seq_len=16,
  )  # fmt: skip
  base = jax.jit(lambda k: model_lib.init_params(cfg, k))(jax.random.key(0))

  def rms(x):
    return float(jnp.sqrt(jnp.mean(jnp.square(x))))

  frozen, weight_errors = {}, {}
  for kind in ('int8', 'nf4', 'int4'):
    qcfg = dataclasses.replace(cfg, weight_quant=kind)
    frozen[kind] = jax.jit(lambda p, c=qcfg: lora.freeze(p, c, jnp.bfloat16))(base)
    assert sum(x.nbytes for x in jax.tree.leaves(frozen[kind])) == lora.base_bytes(qcfg, 2)
    up = jax.jit(quantize.dequantize_tree)(frozen[kind])['blocks']['mlp']['up_proj']
    weight_errors[kind] = rms(up - base['blocks']['mlp']['up_proj'])
  assert weight_errors['int8'] < weight_errors['nf4'] < weight_errors['int4'], weight_errors
  q = frozen['nf4']['blocks']['attn']['q_proj']
  assert q.dtype == jnp.uint8 and q.shape == (1, 32, 4, 16)  # d_model halved: two per byte
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
  want = jax.jit(lambda p: model_lib.merge(cfg, p)(tokens))(base)
  nf4_cfg = dataclasses.replace(cfg, weight_quant='nf4')
  got = jax.jit(lambda p: model_lib.merge(nf4_cfg, p)(tokens))(frozen['nf4'])
  error = rms(got - want) / rms(want - want.mean())
  assert 0 < error < 0.15, error
