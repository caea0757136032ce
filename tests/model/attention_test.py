"""Attention: masks, the xla backend against a plain numpy statement, visibility by gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.model import attention


def numpy_attention(q, k, v, visible):
  """softmax(q k^T / sqrt(H)) v with K/V heads repeated for GQA; visible [B, L, L]."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  logits = np.einsum('blnh,bsnh->bnls', q, k) / np.sqrt(q.shape[-1])
  logits = np.where(visible[:, None], logits, -1e30)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum('bnls,bsnh->blnh', probs, v)


def test_mask_kinds():
  causal = np.asarray(attention.attention_mask(4, kind='causal'))[0]
  np.testing.assert_array_equal(causal, np.tril(np.ones((4, 4), bool)))
  block = np.asarray(attention.attention_mask(4, kind='block_causal', block_size=2))[0]
  np.testing.assert_array_equal(block, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
  padded = np.asarray(
    attention.attention_mask(3, kind='bidirectional', valid_length_B=jnp.array([2]))
  )[0]
  np.testing.assert_array_equal(padded, [[1, 1, 0]] * 3)
  seg = np.asarray(
    attention.attention_mask(3, kind='bidirectional', segment_ids_BL=jnp.array([[1, 1, 2]]))
  )[0]
  np.testing.assert_array_equal(seg, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])


@pytest.mark.parametrize('kind', ['bidirectional', 'causal', 'block_causal'])
@pytest.mark.parametrize('num_kv', [4, 2, 1])
def test_xla_attention_matches_numpy(kind, num_kv):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 8, 4, 16))
  k = jax.random.normal(kk, (2, 8, num_kv, 16))
  v = jax.random.normal(kv, (2, 8, num_kv, 16))
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1] * 8])
  lengths = jnp.array([8, 5])
  got = attention.xla_attention(
    q, k, v, kind=kind, block_size=4, segment_ids_BL=segments, valid_length_B=lengths
  )
  visible = np.asarray(
    attention.attention_mask(
      8, kind=kind, block_size=4, segment_ids_BL=segments, valid_length_B=lengths
    )
  )
  np.testing.assert_allclose(got, numpy_attention(q, k, v, visible), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kind', ['bidirectional', 'causal', 'block_causal'])
def test_visibility_by_gradients(kind):
  """Output i depends on input j exactly where the mask says (nanodo's causality test)."""
  length = 8
  x = jax.random.normal(jax.random.key(1), (1, length, 2, 8))

  def out_at(i):
    return lambda x: attention.xla_attention(x, x, x, kind=kind, block_size=4)[0, i].sum()

  visible = np.asarray(attention.attention_mask(length, kind=kind, block_size=4))[0]
  for i in range(length):
    grad = np.asarray(jax.grad(out_at(i))(x))[0]
    depends = np.abs(grad).sum(axis=(1, 2)) > 0
    np.testing.assert_array_equal(depends, visible[i], err_msg=f'query {i}')


def test_cudnn_refuses_dense_masks():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match='block_causal'):
    attention.cudnn_attention(q, q, q, kind='block_causal', block_size=2)


@pytest.mark.gpu
def test_cudnn_matches_xla_on_gpu():
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 128, 4, 64), jnp.bfloat16)
  k = jax.random.normal(kk, (2, 128, 2, 64), jnp.bfloat16)
  v = jax.random.normal(kv, (2, 128, 2, 64), jnp.bfloat16)
  for kind in ('bidirectional', 'causal'):
    ref = attention.xla_attention(q, k, v, kind=kind)
    got = attention.cudnn_attention(q, k, v, kind=kind)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2)
