"""The training kernel's three Pallas programs and their pallas_calls: the forward (output and
row logsumexp), dQ, and dK with dV (the query heads of a kv head in one program). The backward
recomputes probabilities from the logsumexp, so no [L, L] tensor reaches memory; the custom VJP
that joins them is flash_attention._flash.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dlmjax.kernels.flash_blocks import _LOG2E, _attend, _dot, _live_loop, _logits, _params
from dlmjax.kernels.flash_masks import _live_tiles, _ranges


def _fwd_kernel(
  range_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, mask, block_k, scale
):
  block_q = q_ref.shape[0]
  q0 = pl.program_id(0) * block_q
  seg_q = seg_q_ref[...]

  def logits(q, ks, k0):
    return _logits(q, k_ref[ks, :], scale, mask, q0, k0, seg_q, seg_k_ref[ks], range_ref[2])

  o, lse = _attend(q_ref[...], v_ref, range_ref, logits, block_k)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(
  range_ref,
  seg_q_ref,
  seg_k_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dq_ref,
  *,
  mask,
  block_k,
  scale,
):
  block_q, head_dim = q_ref.shape
  q0 = pl.program_id(0) * block_q
  q, do, seg_q = q_ref[...], do_ref[...], seg_q_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  valid = range_ref[2]

  def body(j, dq):
    ks = pl.ds(j * block_k, block_k)
    k = k_ref[ks, :]
    s = _logits(q, k, scale, mask, q0, j * block_k, seg_q, seg_k_ref[ks], valid)
    p = jnp.exp2(s - lse[:, None])
    dp = _dot(do, v_ref[ks, :], trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = _live_loop(range_ref, body, jnp.zeros((block_q, head_dim), jnp.float32))
  dq_ref[...] = (dq * (scale / _LOG2E)).astype(dq_ref.dtype)


def _dkv_kernel(range_ref, seg_q_ref, seg_k_ref, k_ref, v_ref, *refs, mask, block_q, groups, scale):
  q_refs, do_refs, lse_refs, delta_refs = (refs[i * groups : (i + 1) * groups] for i in range(4))
  dk_ref, dv_ref = refs[4 * groups :]
  block_k, head_dim = k_ref.shape
  k0 = pl.program_id(0) * block_k
  k, v, seg_k = k_ref[...], v_ref[...], seg_k_ref[...]
  valid = range_ref[2]
  dk = jnp.zeros((block_k, head_dim), jnp.float32)
  dv = jnp.zeros((block_k, head_dim), jnp.float32)
  for g in range(groups):  # The query heads sharing this kv head.
    q_ref, do_ref, lse_ref, delta_ref = q_refs[g], do_refs[g], lse_refs[g], delta_refs[g]

    def body(i, carry, q_ref=q_ref, do_ref=do_ref, lse_ref=lse_ref, delta_ref=delta_ref):
      dk, dv = carry
      qs = pl.ds(i * block_q, block_q)
      q, do = q_ref[qs, :], do_ref[qs, :]
      s = _logits(q, k, scale, mask, i * block_q, k0, seg_q_ref[qs], seg_k, valid)
      p = jnp.exp2(s - lse_ref[qs][:, None])
      dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
      dp = _dot(do, v, trans_b=True)
      ds = p * (dp - delta_ref[qs][:, None])
      return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

    dk, dv = _live_loop(range_ref, body, (dk, dv))
  dk_ref[...] = (dk * (scale / _LOG2E)).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wiring.


def _forward(q, k, v, seg_BL, valid_B, mask, tiles, interpret):
  batch, length, num_heads, head_dim = q.shape
  groups = num_heads // k.shape[2]
  t = tiles.fwd
  ranges = _ranges(_live_tiles(mask, seg_BL, valid_B, t.block_q, t.block_k), valid_B)
  scale = head_dim**-0.5 * _LOG2E
  full = pl.BlockSpec((None, length, None, head_dim), lambda i, b, n: (b, 0, n // groups, 0))
  own = pl.BlockSpec((None, t.block_q, None, head_dim), lambda i, b, n: (b, i, n, 0))
  o, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, mask=mask, block_k=t.block_k, scale=scale),
    grid=(length // t.block_q, batch, num_heads),
    in_specs=[
      pl.BlockSpec((None, None, 8), lambda i, b, n: (b, i, 0)),
      pl.BlockSpec((None, t.block_q), lambda i, b, n: (b, i)),
      pl.BlockSpec((None, length), lambda i, b, n: (b, 0)),
      own,
      full,
      full,
    ],
    out_specs=[own, pl.BlockSpec((None, None, t.block_q), lambda i, b, n: (b, n, i))],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((batch, num_heads, length), jnp.float32),
    ],
    interpret=interpret,
    name='flash_attention_fwd',
    **_params(t, interpret),
  )(ranges, seg_BL, seg_BL, q, k, v)
  return o, lse


def _backward(q, k, v, seg_BL, valid_B, o, lse, do, mask, tiles, interpret):
  batch, length, num_heads, head_dim = q.shape
  num_kv = k.shape[2]
  groups = num_heads // num_kv
  scale = head_dim**-0.5 * _LOG2E
  delta = jnp.einsum('blnh,blnh->bnl', o.astype(jnp.float32), do.astype(jnp.float32))

  t = tiles.dq
  ranges = _ranges(_live_tiles(mask, seg_BL, valid_B, t.block_q, t.block_k), valid_B)
  full = pl.BlockSpec((None, length, None, head_dim), lambda i, b, n: (b, 0, n // groups, 0))
  own = pl.BlockSpec((None, t.block_q, None, head_dim), lambda i, b, n: (b, i, n, 0))
  own_row = pl.BlockSpec((None, None, t.block_q), lambda i, b, n: (b, n, i))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, mask=mask, block_k=t.block_k, scale=scale),
    grid=(length // t.block_q, batch, num_heads),
    in_specs=[
      pl.BlockSpec((None, None, 8), lambda i, b, n: (b, i, 0)),
      pl.BlockSpec((None, t.block_q), lambda i, b, n: (b, i)),
      pl.BlockSpec((None, length), lambda i, b, n: (b, 0)),
      own,
      full,
      full,
      own,
      own_row,
      own_row,
    ],
    out_specs=own,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    interpret=interpret,
    name='flash_attention_dq',
    **_params(t, interpret),
  )(ranges, seg_BL, seg_BL, q, k, v, do, lse, delta)

  t = tiles.dkv
  live = _live_tiles(mask, seg_BL, valid_B, t.block_q, t.block_k)
  ranges = _ranges(jnp.swapaxes(live, 1, 2), valid_B)
  own = pl.BlockSpec((None, t.block_k, None, head_dim), lambda j, b, h: (b, j, h, 0))

  def query_head(g):
    return (
      pl.BlockSpec((None, length, None, head_dim), lambda j, b, h: (b, 0, h * groups + g, 0)),
      pl.BlockSpec((None, None, length), lambda j, b, h: (b, h * groups + g, 0)),
    )

  rows = [query_head(g) for g in range(groups)]
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, mask=mask, block_q=t.block_q, groups=groups, scale=scale),
    grid=(length // t.block_k, batch, num_kv),
    in_specs=[
      pl.BlockSpec((None, None, 8), lambda j, b, h: (b, j, 0)),
      pl.BlockSpec((None, length), lambda j, b, h: (b, 0)),
      pl.BlockSpec((None, t.block_k), lambda j, b, h: (b, j)),
      own,
      own,
    ]
    + [r[0] for r in rows] * 2
    + [r[1] for r in rows] * 2,
    out_specs=[own, own],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    interpret=interpret,
    name='flash_attention_dkv',
    **_params(t, interpret),
  )(ranges, seg_BL, seg_BL, k, v, *[q] * groups, *[do] * groups, *[lse] * groups, *[delta] * groups)
  return dq, dk, dv
