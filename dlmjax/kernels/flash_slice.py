"""Flash attention of a slice of queries against a whole sequence's keys: the sampler's cached
decoding step, forward only. flash_attention_slice reads the keys it is given;
flash_attention_slice_cached reads them in place from a stacked per-layer cache, with the slice's
fresh keys in their places.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dlmjax.kernels.flash_blocks import (
  _LOG2E,
  _NEG,
  Tile,
  _attend,
  _dot,
  _live_loop,
  _logits,
  _online_end,
  _online_start,
  _online_step,
  _params,
  supports_head_dim,
)
from dlmjax.kernels.flash_masks import _Mask, _ranges, _slice_live_tiles, _visible, document_keys

SLICE_TILE = Tile(64, 64, 4, 2)  # rows (the grouped heads' queries) x keys, for the slice kernel
SLICE_KINDS = ('bidirectional', 'causal', 'block_causal')


def flash_attention_slice(
  q_BQNH,
  k_BSKH,
  v_BSKH,
  *,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
  tile: Tile | None = None,
  interpret: bool | None = None,
):
  """Forward-only flash attention of Q queries against S >= Q keys (a cached forward: a block of
  the canvas against every layer's kept K/V, docs/benchmarks.md, Sampler).

  The queries are the key positions [query_start, query_start + Q) (query_start may be traced)
  and see what those positions see in the whole-sequence mask (`attention_mask`'s query_start);
  segment ids and lengths cover the S keys. The query heads sharing a kv head run in one program
  as G * Q rows, so each K/V tile is read once per kv head, and key tiles no row can see (after
  a causal / block-causal row's block, past the length, other documents) are skipped. A query
  that sees no key returns 0. No gradient: decoding only (the training path is flash_attention).
  """
  batch, length, num_kv, head_dim = k_BSKH.shape
  if k_BSKH.shape != (q_BQNH.shape[0], length, num_kv, q_BQNH.shape[-1]) or (
    v_BSKH.shape != k_BSKH.shape
  ):
    raise ValueError(
      f'k {k_BSKH.shape} and v {v_BSKH.shape} must be [B, S, K, H] for q {q_BQNH.shape}'
    )
  mask = dict(
    kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL, valid_length_B=valid_length_B
  )
  plan = _SlicePlan.make(q_BQNH, length, num_kv, query_start, tile, interpret, **mask)
  pad_k = ((0, 0), (0, plan.padded_k - length), (0, 0), (0, 0))
  k, v = (jnp.pad(x, pad_k) if plan.padded_k != length else x for x in (k_BSKH, v_BSKH))
  full = pl.BlockSpec((None, plan.padded_k, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  kernel = functools.partial(
    _slice_kernel, mask=plan.mask, block_k=plan.block_k, scale=plan.scale, period=plan.padded_q
  )
  return plan.call(kernel, [full, full], [k, v], 'flash_attention_slice')


def flash_attention_slice_cached(
  q_BQNH,
  k_BQKH,
  v_BQKH,
  k_cache_LBSKH,
  v_cache_LBSKH,
  layer,
  *,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
  tile: Tile | None = None,
  interpret: bool | None = None,
):
  """flash_attention_slice against keys read in place from a stacked cache: every layer's K/V
  [layers, B, S, K, H], of which layer `layer` (traced: a scan's index) is read, except at the
  slice's own positions [query_start, query_start + Q), whose keys and values are the slice's
  fresh k, v [B, Q, K, H]. The same as flash_attention_slice(q, cache[layer] with k, v written
  in at query_start), without that per-layer copy of the cache: at the 1.7B's sampler shape it
  is ~134 MB of memory traffic per layer per step, which the PyTorch loop of the same algorithm
  (its cache written in place) never pays (docs/benchmarks.md, Sampler, K/V caches).

  The kernel runs the fresh keys as their own tiles (Q padded to 16 rows) and masks their
  positions in the cache's tiles; a key tile that would run past S (S not a multiple of the
  tile) is read shifted back to end at S, its keys before the tile's start masked, so no read
  leaves the cache and nothing is padded. Caches shorter than 16 keys take the copying path.
  """
  layers, batch, length, num_kv, head_dim = k_cache_LBSKH.shape
  num_queries = q_BQNH.shape[1]
  if v_cache_LBSKH.shape != k_cache_LBSKH.shape or q_BQNH.shape[0] != batch:
    raise ValueError(
      f'caches k {k_cache_LBSKH.shape}, v {v_cache_LBSKH.shape} must be [layers, B, S, K, H] '
      f'for q {q_BQNH.shape}'
    )
  if k_BQKH.shape != (batch, num_queries, num_kv, head_dim) or v_BQKH.shape != k_BQKH.shape:
    raise ValueError(f'fresh k {k_BQKH.shape}, v {v_BQKH.shape} must be [B, Q, K, H]')
  mask = dict(
    kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL, valid_length_B=valid_length_B
  )
  if length < 16:  # no whole 16-key tile to read: the copying path.
    k, v = (
      lax.dynamic_update_slice_in_dim(
        lax.dynamic_index_in_dim(c, layer, 0, keepdims=False), f.astype(c.dtype), query_start, 1
      )
      for c, f in ((k_cache_LBSKH, k_BQKH), (v_cache_LBSKH, v_BQKH))
    )
    return flash_attention_slice(
      q_BQNH, k, v, query_start=query_start, tile=tile, interpret=interpret, **mask
    )
  tile = tile or SLICE_TILE  # key tiles no longer than the cache (a last one is read shifted)
  tile = dataclasses.replace(tile, block_k=min(tile.block_k, 1 << (length.bit_length() - 1)))
  plan = _SlicePlan.make(q_BQNH, length, num_kv, query_start, tile, interpret, layer, **mask)
  # The fresh rows, padded to the queries' 16-row multiple (the padding masked in the kernel).
  pad_q = ((0, 0), (0, plan.padded_q - num_queries), (0, 0), (0, 0))
  fresh_k, fresh_v = (jnp.pad(f.astype(k_cache_LBSKH.dtype), pad_q) for f in (k_BQKH, v_BQKH))
  cache = pl.BlockSpec((layers, None, length, None, head_dim), lambda i, b, h: (0, b, 0, h, 0))
  fresh = pl.BlockSpec((None, plan.padded_q, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  seg_fresh = pl.BlockSpec((None, plan.padded_q), lambda i, b, h: (b, 0))
  kernel = functools.partial(
    _slice_cached_kernel,
    mask=plan.mask,
    block_k=plan.block_k,
    block_f=_fit_block(plan.block_k, plan.padded_q),
    num_fresh=num_queries,
    length=length,
    scale=plan.scale,
    period=plan.padded_q,
  )
  return plan.call(
    kernel,
    [cache, cache, fresh, fresh, seg_fresh],
    [k_cache_LBSKH, v_cache_LBSKH, fresh_k, fresh_v, plan.seg_q],
    'flash_attention_slice_cached',
  )


@dataclasses.dataclass(frozen=True)
class _SlicePlan:
  """What both slice kernels share: the grouped heads' query rows, the key tiles each row tile
  visits, and the pallas_call around a kernel's key operands."""

  q: jax.Array  # [B, K, G * padded_q, H]: row r is head r // padded_q, query r % padded_q
  seg_rows: jax.Array  # [B, rows]: each row's segment id
  seg_q: jax.Array  # [B, padded_q]: the queries' (= the fresh keys') segment ids
  seg_k: jax.Array  # [B, padded_k]
  ranges: jax.Array  # [B, row tiles, 8]: _ranges, slot 5 query_start, slot 6 the cache layer
  mask: _Mask
  tile: Tile
  block_r: int
  block_k: int
  padded_q: int
  padded_k: int
  num_queries: int
  num_heads: int
  interpret: bool

  @property
  def scale(self):
    return self.q.shape[-1] ** -0.5 * _LOG2E

  @classmethod
  def make(
    cls,
    q_BQNH,
    length,
    num_kv,
    query_start,
    tile,
    interpret,
    layer=0,
    *,
    kind,
    block_size,
    segment_ids_BL,
    valid_length_B,
  ):
    batch, num_queries, num_heads, head_dim = q_BQNH.shape
    if num_queries > length:
      raise ValueError(f'{num_queries} queries against {length} keys: a slice is at most the keys')
    if num_heads % num_kv:
      raise ValueError(f'{num_heads} query heads do not split into {num_kv} kv head groups')
    if kind not in SLICE_KINDS:
      raise ValueError(f'the slice kernel takes mask kinds {SLICE_KINDS}, got {kind!r}')
    if kind == 'block_causal' and block_size < 1:
      raise ValueError('block_causal attention needs block_size >= 1')
    if interpret is None:
      interpret = jax.default_backend() != 'gpu'
    if not interpret and not supports_head_dim(head_dim):
      raise ValueError(
        f'the pallas attention kernel needs a power-of-two head_dim >= 16, got '
        f'{head_dim}; use the xla attention backend'
      )
    tile = tile or SLICE_TILE
    padded_k = -(-length // 16) * 16
    groups = num_heads // num_kv
    padded_q = -(-num_queries // 16) * 16  # Triton's matmuls take >= 16 rows.
    rows = groups * padded_q  # row r: head r // padded_q of the group, query r % padded_q.
    block_r, block_k = _fit_block(tile.block_q, rows), _fit_block(tile.block_k, padded_k)
    start = jnp.asarray(query_start, jnp.int32)
    lengths = valid_length_B is not None or padded_k != length
    valid_B = jnp.full((batch,), length, jnp.int32)
    if valid_length_B is not None:
      valid_B = jnp.minimum(valid_B, valid_length_B.astype(jnp.int32))
    segments = segment_ids_BL is not None
    mask = _Mask(kind, block_size, segments, lengths)
    if segments:
      seg_BS = segment_ids_BL.astype(jnp.int32)
      if mask.per_document:  # blocks count from each document's start, as flash_attention's
        seg_BS = document_keys(seg_BS, block_size)
      edge = 'edge' if mask.per_document else 'constant'  # per-document ids stay increasing
      seg_k = jnp.pad(seg_BS, ((0, 0), (0, padded_k - length)), mode=edge)
      seg_q = lax.dynamic_slice_in_dim(seg_BS, start, num_queries, 1)
      seg_q = jnp.pad(seg_q, ((0, 0), (0, padded_q - num_queries)), mode='edge')
    else:
      seg_k = jnp.zeros((batch, padded_k), jnp.int32)
      seg_q = jnp.zeros((batch, padded_q), jnp.int32)
    q = jnp.pad(q_BQNH, ((0, 0), (0, padded_q - num_queries), (0, 0), (0, 0)))
    q = q.reshape(batch, padded_q, num_kv, groups, head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv, rows, head_dim)
    seg_rows = jnp.tile(seg_q, (1, groups))
    position_R = start + jnp.arange(rows) % padded_q
    live = _slice_live_tiles(mask, position_R, seg_rows, seg_k, valid_B, block_r, block_k)
    ranges = _ranges(live, valid_B).at[..., 5].set(start)
    ranges = ranges.at[..., 6].set(jnp.asarray(layer, jnp.int32))
    return cls(
      q=q,
      seg_rows=seg_rows,
      seg_q=seg_q,
      seg_k=seg_k,
      ranges=ranges,
      mask=mask,
      tile=tile,
      block_r=block_r,
      block_k=block_k,
      padded_q=padded_q,
      padded_k=padded_k,
      num_queries=num_queries,
      num_heads=num_heads,
      interpret=interpret,
    )

  def call(self, kernel, key_specs, key_operands, name):
    """kernel(range, seg rows, seg keys, q, *key operands, out) over (row tile, b, kv head)."""
    batch, num_kv, rows, head_dim = self.q.shape
    own = pl.BlockSpec((None, None, self.block_r, head_dim), lambda i, b, h: (b, h, i, 0))
    o = pl.pallas_call(
      kernel,
      grid=(rows // self.block_r, batch, num_kv),
      in_specs=[
        pl.BlockSpec((None, None, 8), lambda i, b, h: (b, i, 0)),
        pl.BlockSpec((None, self.block_r), lambda i, b, h: (b, i)),
        pl.BlockSpec((None, self.padded_k), lambda i, b, h: (b, 0)),
        own,
        *key_specs,
      ],
      out_specs=own,
      out_shape=jax.ShapeDtypeStruct(self.q.shape, self.q.dtype),
      interpret=self.interpret,
      name=name,
      **_params(
        dataclasses.replace(self.tile, block_q=self.block_r, block_k=self.block_k), self.interpret
      ),
    )(self.ranges, self.seg_rows, self.seg_k, self.q, *key_operands)
    groups = self.num_heads // num_kv
    o = o.reshape(batch, num_kv, groups, self.padded_q, head_dim).transpose(0, 3, 1, 2, 4)
    return o.reshape(batch, self.padded_q, self.num_heads, head_dim)[:, : self.num_queries]


def _fit_block(block, length):
  """The largest power of two <= block dividing length (a multiple of 16)."""
  while length % block:
    block //= 2
  return block


def _slice_kernel(
  range_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, o_ref, *, mask, block_k, scale, period
):
  block_r = q_ref.shape[0]
  rows = pl.program_id(0) * block_r + lax.broadcasted_iota(jnp.int32, (block_r, block_k), 0)
  q_pos = range_ref[5] + lax.rem(rows, period)  # query_start + the row's query index
  seg_q = seg_q_ref[...]

  def logits(q, ks, k0):
    return _logits(
      q, k_ref[ks, :], scale, mask, 0, k0, seg_q, seg_k_ref[ks], range_ref[2], q_pos=q_pos
    )

  o_ref[...] = _attend(q_ref[...], v_ref, range_ref, logits, block_k)[0].astype(o_ref.dtype)


def _slice_cached_kernel(
  range_ref,
  seg_q_ref,
  seg_k_ref,
  q_ref,
  k_ref,
  v_ref,
  fresh_k_ref,
  fresh_v_ref,
  seg_f_ref,
  o_ref,
  *,
  mask,
  block_k,
  block_f,
  num_fresh,
  length,
  scale,
  period,
):
  """_slice_kernel with keys from the cache's layer range_ref[6] (k_ref, v_ref: [layers, S, H])
  outside the slice and from fresh_k_ref / fresh_v_ref ([padded Q, H]) inside it."""
  block_r = q_ref.shape[0]
  start, layer, valid = range_ref[5], range_ref[6], range_ref[2]
  q, seg_q = q_ref[...], seg_q_ref[...]

  def row_positions(cols):  # query_start + the row's query index, [block_r, cols]
    rows = pl.program_id(0) * block_r + lax.broadcasted_iota(jnp.int32, (block_r, cols), 0)
    return start + lax.rem(rows, period)

  fresh_pos, q_pos = row_positions(block_f), row_positions(block_k)

  def fresh_body(j, carry):  # keys start + [j * block_f, (j + 1) * block_f) of the slice
    fs = pl.ds(j * block_f, block_f)
    s = _dot(q, fresh_k_ref[fs, :], trans_b=True) * scale
    index = j * block_f + lax.broadcasted_iota(jnp.int32, (block_r, block_f), 1)
    visible = index < num_fresh  # the padding rows are no keys
    if mask.dense:
      k0, seg_f = start + j * block_f, seg_f_ref[fs]
      visible = visible & _visible(mask, 0, k0, block_r, block_f, seg_q, seg_f, valid, fresh_pos)
    return _online_step(carry, jnp.where(visible, s, _NEG), fresh_v_ref[fs, :])

  def cache_body(j, carry):
    first = j * block_k
    k0 = first if length % block_k == 0 else jnp.minimum(first, length - block_k)
    ks = pl.ds(k0, block_k)
    s = _logits(q, k_ref[layer, ks, :], scale, mask, 0, k0, seg_q, seg_k_ref[ks], valid, q_pos)
    k_pos = k0 + lax.broadcasted_iota(jnp.int32, (block_r, block_k), 1)
    hidden = (k_pos >= start) & (k_pos < start + num_fresh)  # the fresh keys' places
    if length % block_k:  # a shifted last tile: keys before `first` were the previous tile's
      hidden = hidden | (k_pos < first)
    return _online_step(carry, jnp.where(hidden, _NEG, s), v_ref[layer, ks, :])

  carry = lax.fori_loop(0, period // block_f, fresh_body, _online_start(*q.shape))
  o_ref[...] = _online_end(_live_loop(range_ref, cache_body, carry))[0].astype(o_ref.dtype)
