"""The Mosaic GPU flash attention: it lowers for CUDA, refuses what it cannot take, is saved by the
remat policies, and (on a Hopper GPU) matches `xla_attention`.

Mosaic GPU kernels have no interpret mode, so on CPU the kernels are lowered for CUDA without
running: that traces every kernel body and checks its shapes, layouts, dtypes and pipelines.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.kernels import flash_attention_mgpu as fa_mgpu
from dlmjax.model import attention as attention_lib
from dlmjax.model import transformer
from tests.kernels.flash_attention_test import make_case, rel_err, value_and_grads


def _shapes(batch, length, heads, kv_heads, head_dim, dtype):
  return (
    jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype),
    jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), dtype),
  )


@pytest.mark.parametrize(
  'heads, kv_heads, head_dim, dtype, lengths',
  [
    (4, 2, 128, jnp.bfloat16, False),  # grouped kv heads: dK / dV sum the group in the kernel
    (4, 2, 128, jnp.bfloat16, True),
    (2, 2, 64, jnp.float16, True),
  ],
)
def test_forward_and_backward_lower_for_cuda(heads, kv_heads, head_dim, dtype, lengths):
  q, k = _shapes(2, 256, heads, kv_heads, head_dim, dtype)
  valid = jax.ShapeDtypeStruct((2,), jnp.int32) if lengths else None

  def loss(q, k, v, valid):
    return fa_mgpu.flash_attention_mgpu(q, k, v, valid_length_B=valid).astype(jnp.float32).sum()

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  lowered = jax.jit(grad).trace(q, k, k, valid).lower(lowering_platforms=('cuda',))
  text = lowered.as_text()
  assert text.count('mosaic_gpu') >= 3  # forward, dQ, dK + dV
  out = jax.eval_shape(grad, q, k, k, valid)
  assert [g.shape for g in out[1]] == [q.shape, k.shape, k.shape]
  assert all(g.dtype == dtype for g in out[1])


def test_refuses_what_it_cannot_take_and_says_why():
  f32, bf16 = jnp.float32, jnp.bfloat16
  for (q, k), want in [
    (_shapes(1, 256, 2, 2, 128, f32), 'dtype float32'),
    (_shapes(1, 256, 2, 2, 96, bf16), 'head_dim 96'),
    (_shapes(1, 200, 2, 2, 128, bf16), 'length 200 (needs a multiple of 128)'),
    (_shapes(1, 256, 3, 2, 128, bf16), '3 query heads'),
  ]:
    assert want in fa_mgpu.supported(q.shape, k.shape, q.dtype)
    with pytest.raises(ValueError, match='Mosaic GPU attention kernel does not take'):
      jax.eval_shape(fa_mgpu.flash_attention_mgpu, q, k, k)
  q, k = _shapes(1, 256, 4, 2, 128, bf16)
  assert fa_mgpu.supported(q.shape, k.shape, q.dtype) is None


def test_attention_remat_policies_keep_the_kernel_outputs(capsys):
  """save_dots_attention must keep o and lse (the backward's inputs) instead of re-running."""
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    return fa_mgpu.flash_attention_mgpu(q, k, v).astype(jnp.float32).sum()

  for name, saved in [('save_dots', 0), ('save_dots_attention', 2), ('save_activations', 2)]:
    policy = transformer.REMAT_POLICIES[name]
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), q, q, q)
    lines = capsys.readouterr().out.splitlines()
    kept = [line for line in lines if 'flash_attention_mgpu' in line]
    assert len(kept) == saved, (name, lines)
    if saved:
      assert any(line.startswith('f32[1,2,256]') for line in kept)  # the row logsumexp


def test_pallas_backend_takes_triton_off_hopper():
  if jax.default_backend() == 'gpu':
    pytest.skip('CPU rule')
  assert not attention_lib._on_hopper()  # pylint: disable=protected-access


@pytest.mark.gpu
@pytest.mark.parametrize(
  'heads, kv_heads, head_dim, valid', [(4, 2, 128, None), (2, 2, 64, None), (8, 2, 128, [512, 301])]
)
def test_gpu_matches_reference(heads, kv_heads, head_dim, valid):
  if not attention_lib._on_hopper():  # pylint: disable=protected-access
    pytest.skip('needs a Hopper (sm90) GPU')
  q, k, v, do, _, valid = make_case(
    5,
    batch=2,
    length=512,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
    valid=valid,
    dtype=jnp.bfloat16,
  )
  kw = dict(valid_length_B=valid)
  got = value_and_grads(lambda q, k, v: fa_mgpu.flash_attention_mgpu(q, k, v, **kw), q, k, v, do)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = value_and_grads(
    lambda q, k, v: attention_lib.xla_attention(q, k, v, kind='bidirectional', **kw), *f32
  )
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    assert rel_err(g.astype(jnp.float32), w) < 1e-2
  backend = attention_lib.pallas_attention(q, k, v, kind='bidirectional', **kw)
  np.testing.assert_array_equal(np.asarray(backend, np.float32), np.asarray(got[0], np.float32))
