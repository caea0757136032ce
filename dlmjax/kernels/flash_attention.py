"""Flash attention as a Pallas kernel: every mask kind with documents and padding, no dense mask.

cuDNN is fastest on plain attention but needs an [L, L] mask (slow) for packed documents and
block-causal masks. This kernel builds the mask from iotas, segment ids and lengths per tile and
skips key tiles that no query of the tile can see: each tile row loops over at most two runs of live
tiles, so the two-stream block-diffusion mask (a noisy block's own tile and the clean tiles before
it) skips the noisy tiles in between. Forward keeps the row logsumexp; the backward
(custom VJP) recomputes probabilities from it in two kernels (dQ; dK and dV), so no [L, L] tensor
ever reaches memory. It lowers through Pallas' Triton backend on GPU and runs in interpret mode
on CPU. On Hopper, plain bidirectional attention (with or without padding lengths) goes to the
Mosaic GPU kernel instead (`flash_attention_mgpu.py`, 1.35x this one's speed there).
Matmuls take the input dtype (bf16) and accumulate in f32; the softmax is f32 in base 2 (exp2),
the residual logsumexp too. Speed against cuDNN: docs/benchmarks.md, Flash attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MASK_KINDS = ('bidirectional', 'causal', 'block_causal', 'two_stream')
_NEG = -1e30  # finite: a masked logit minus a masked running max stays 0, never NaN.
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Tile:
  """One kernel's tile: query rows x key rows, and Triton's warps and pipeline stages."""

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tiles of the three kernels; sizes are powers of two, shrunk to divide the length."""

  fwd: Tile = Tile(128, 128, 8, 3)
  dq: Tile = Tile(64, 64, 4, 2)
  dkv: Tile = Tile(64, 64, 4, 2)


@dataclasses.dataclass(frozen=True)
class _Mask:
  """The static part of the mask: kind and which of segments / lengths apply."""

  kind: str
  block_size: int
  segments: bool
  lengths: bool
  half: int = 0  # two_stream: the length of one stream (keys past 2 * half are padding).
  skip: bool = True  # False visits every tile (the mask still applies): the no-skipping baseline

  @property
  def dense(self):
    return self.kind != 'bidirectional' or self.segments or self.lengths

  @property
  def per_document(self):
    """Blocks count from each document's start: the ids are document_keys (phase inside)."""
    return self.segments and self.kind in ('block_causal', 'two_stream')


def flash_attention(
  q_BLNH,
  k_BLKH,
  v_BLKH,
  *,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  tiles: Tiles | None = None,
  interpret: bool | None = None,
  skip_tiles: bool = True,
):
  """Softmax(q k^T / sqrt(H)) v with the visibility of `model.attention.attention_mask`.

  Same contract as `xla_attention`, except that a query that sees no key returns 0 (the dense
  reference returns an arbitrary average there) and gets no gradient. Any length works: it is
  padded to a whole tile, the padding hidden by the length mask. `interpret` defaults to True
  off GPU. skip_tiles=False visits every tile (the same result; the baseline that measures what
  skipping buys, benchmarks/block_diffusion.py).
  """
  batch, length, num_heads, head_dim = q_BLNH.shape
  num_kv = k_BLKH.shape[2]
  if k_BLKH.shape != (batch, length, num_kv, head_dim) or v_BLKH.shape != k_BLKH.shape:
    raise ValueError(
      f'k {k_BLKH.shape} and v {v_BLKH.shape} must be [B, L, K, H] matching q {q_BLNH.shape}'
    )
  if num_heads % num_kv:
    raise ValueError(f'{num_heads} query heads do not split into {num_kv} kv head groups')
  if kind not in MASK_KINDS:
    raise ValueError(f'unknown attention mask kind {kind!r}; known: {MASK_KINDS}')
  if kind in ('block_causal', 'two_stream') and block_size < 1:
    raise ValueError(f'{kind} attention needs block_size >= 1')
  if kind == 'two_stream' and length % 2:
    raise ValueError(f'two_stream attention needs [x_t || x_0] of even length, got {length}')
  half = length // 2 if kind == 'two_stream' else 0
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  tiles = tiles or Tiles()
  if not interpret and not supports_head_dim(head_dim):
    raise ValueError(
      f'the pallas attention kernel needs a power-of-two head_dim >= 16, got '
      f'{head_dim}; use the xla or cudnn attention backend'
    )
  quantum = max(max(t.block_q, t.block_k) for t in (tiles.fwd, tiles.dq, tiles.dkv))
  quantum = min(quantum, max(16, 1 << (length - 1).bit_length()))
  padded = -(-length // quantum) * quantum
  lengths = valid_length_B is not None or padded != length
  if lengths:  # two_stream: valid keys per stream (their index within it).
    valid_B = jnp.full((batch,), half or length, jnp.int32)
    if valid_length_B is not None:
      valid_B = jnp.minimum(valid_B, valid_length_B.astype(jnp.int32))
  else:
    valid_B = jnp.zeros((batch,), jnp.int32)
  segments = segment_ids_BL is not None
  seg_BL = segment_ids_BL.astype(jnp.int32) if segments else jnp.zeros((batch, length), jnp.int32)
  mask = _Mask(kind, block_size, segments, lengths, half, skip_tiles)
  if mask.per_document:
    if length * block_size >= 2**31:
      raise ValueError(
        f'per-document blocks need length * block_size < 2^31, got {length} * {block_size}'
      )
    seg_BL = document_keys(seg_BL, block_size, half=half)
  if padded != length:
    pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
    q_BLNH, k_BLKH, v_BLKH = (jnp.pad(x, pad) for x in (q_BLNH, k_BLKH, v_BLKH))
    # Per-document ids stay increasing: the padding joins the last document (hidden by length).
    seg_BL = jnp.pad(
      seg_BL, ((0, 0), (0, padded - length)), 'edge' if mask.per_document else 'constant'
    )
  out = _flash(q_BLNH, k_BLKH, v_BLKH, seg_BL, valid_B, mask, _fit(tiles, padded), interpret)
  return out[:, :length]


def stream_index(pos, half: int):
  """A position's index within its stream of [x_t || x_0] (padding past 2 * half stays >= half)."""
  return pos - jnp.where(pos >= half, half, 0)


def two_stream_visible(q, k, *, half: int, block_size: int, q_offset=0, k_offset=0):
  """BD3LM's training mask over [x_t || x_0] (2 * half positions; bd3lms' `block_diff_mask`).

  Blocks count from the start of each stream, or from in-stream index q_offset / k_offset (a
  packed document's start, or anything congruent to it mod block_size: docs/block_diffusion.md,
  Packed documents). A noisy query (q < half) sees its own noisy block and the clean blocks before
  it; a clean query sees the clean blocks up to its own (block-causal); no query sees a noisy key
  of another block, and no clean query sees a noisy key. q, k and the offsets are broadcastable
  integer arrays: the one rule of the XLA reference and of the kernels' tiles.
  """
  clean_q, clean_k = q >= half, k >= half
  block_q = (stream_index(q, half) - q_offset) // block_size
  block_k = (stream_index(k, half) - k_offset) // block_size
  noisy_key = jnp.logical_not(clean_q) & (block_q == block_k)
  clean_key = jnp.where(clean_q, block_q >= block_k, block_q > block_k)
  return jnp.where(clean_k, clean_key, noisy_key)


def document_starts(segment_ids_BL, half: int = 0):
  """Each position's document start: the in-stream index where its run of equal ids begins
  (per stream of [x_t || x_0] when half > 0, both streams holding the same ids)."""
  batch, length = segment_ids_BL.shape
  streams = 2 if half else 1
  ids = segment_ids_BL.reshape(batch, streams, length // streams)
  index = jnp.arange(ids.shape[-1])[None, None]
  starts = jnp.concatenate([jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], -1)
  return lax.cummax(jnp.where(starts, index, 0), axis=2).reshape(batch, length)


def document_keys(segment_ids_BL, block_size: int, half: int = 0):
  """The ids the kernels read for per-document blocks: run index * block_size + phase, the
  phase being the document's start mod block_size. Equal iff same document (run), increasing
  along the row, and key % block_size shifts the block grid (_visible); below 2^31 for any
  length * block_size < 2^31 (runs are counted, not taken from the ids)."""
  batch, length = segment_ids_BL.shape
  streams = 2 if half else 1
  starts = document_starts(segment_ids_BL, half)
  index = jnp.arange(length // streams)[None, None]
  first = (starts.reshape(batch, streams, -1) == index).astype(jnp.int32)
  runs = (jnp.cumsum(first, axis=-1) - 1).reshape(batch, length)
  return runs * block_size + starts % block_size


def supports_head_dim(head_dim: int) -> bool:
  """Triton tiles are powers of two, and its matmuls need at least 16 columns."""
  return head_dim >= 16 and not head_dim & (head_dim - 1)


def _fit(tiles, length):
  """Shrinks each block to the largest power of two that divides the (padded) length."""

  def shrink(block):
    while length % block:
      block //= 2
    return block

  return Tiles(
    *(
      dataclasses.replace(t, block_q=shrink(t.block_q), block_k=shrink(t.block_k))
      for t in (tiles.fwd, tiles.dq, tiles.dkv)
    )
  )


# ---------------------------------------------------------------------------------------------
# Which tiles can see which: computed once per call in plain JAX, read by the kernels.


def _live_tiles(mask, seg_BL, valid_B, block_q, block_k):
  """Bool [B, Q tiles, K tiles]: some query of the Q tile may see some key of the K tile."""
  batch, length = seg_BL.shape
  if not mask.skip:
    return jnp.ones((batch, length // block_q, length // block_k), bool)
  q_last = (jnp.arange(length // block_q) + 1) * block_q - 1
  k_first = jnp.arange(length // block_k) * block_k
  if mask.kind == 'causal':
    live = k_first[None, :] <= q_last[:, None]
  elif mask.kind == 'block_causal':  # in-stream block indices only grow along the row
    block_BL = _block_index(mask, seg_BL)
    q_block = block_BL.reshape(block_BL.shape[0], -1, block_q).max(-1)
    k_block = block_BL.reshape(block_BL.shape[0], -1, block_k).min(-1)
    live = k_block[:, None, :] <= q_block[:, :, None]
  elif mask.kind == 'two_stream':
    live = _two_stream_live(mask, _block_index(mask, seg_BL), block_q, block_k)
  else:
    live = jnp.ones((q_last.size, k_first.size), bool)
  live = jnp.broadcast_to(live if live.ndim == 3 else live[None], (batch, *live.shape[-2:]))
  if mask.lengths:
    first_key = k_first  # the tile's lowest in-stream index (0 where it reaches x_0's start)
    if mask.half:
      straddles = (k_first < mask.half) & (k_first + block_k > mask.half)
      first_key = jnp.where(straddles, 0, stream_index(k_first, mask.half))
    live = live & (first_key[None, None, :] < valid_B[:, None, None])
  if mask.segments:  # Disjoint id ranges share no id; for packed documents this is exact.
    seg_q = seg_BL.reshape(batch, -1, block_q)
    seg_k = seg_BL.reshape(batch, -1, block_k)
    live = live & (
      (seg_k.min(-1)[:, None, :] <= seg_q.max(-1)[:, :, None])
      & (seg_k.max(-1)[:, None, :] >= seg_q.min(-1)[:, :, None])
    )
  return live


def _block_index(mask, seg_BL):
  """int32 [B or 1, L]: each position's block within its stream, counted from its document's
  start with per-document ids (document_keys), else from the stream's start."""
  position = jnp.arange(seg_BL.shape[1])[None]
  phase = seg_BL % mask.block_size if mask.per_document else 0
  return (stream_index(position, mask.half) - phase) // mask.block_size


def _two_stream_live(mask, block_BL, block_q, block_k):
  """Bool [B or 1, Q tiles, K tiles] of the two-stream mask, from the blocks each tile covers.

  A tile covers a run of noisy blocks and/or a run of clean blocks (in-stream block indices; a
  tile may straddle the streams' boundary). A pair is live iff some covered pair is visible:
  noisy-noisy the same block, noisy query - clean key an earlier block, clean-clean the same or
  an earlier one (attention.two_stream_visible).
  """
  rows, length = block_BL.shape
  big = jnp.iinfo(jnp.int32).max

  def cover(tile):
    block_RTi = block_BL.reshape(rows, -1, tile)
    clean_Ti = (jnp.arange(length) >= mask.half).reshape(-1, tile)
    parts = []
    for part_Ti in (~clean_Ti, clean_Ti):
      lo = jnp.where(part_Ti, block_RTi, big).min(-1)
      hi = jnp.where(part_Ti, block_RTi, -big).max(-1)
      parts.append((part_Ti.any(-1)[None], lo, hi))
    return parts

  (qn, qn_lo, qn_hi), (qc, qc_lo, qc_hi) = (
    tuple(x[:, :, None] for x in part) for part in cover(block_q)
  )
  (kn, kn_lo, kn_hi), (kc, kc_lo, _) = (
    tuple(x[:, None, :] for x in part) for part in cover(block_k)
  )
  noisy_noisy = qn & kn & (qn_lo <= kn_hi) & (kn_lo <= qn_hi)
  noisy_clean = qn & kc & (qn_hi > kc_lo)
  clean_clean = qc & kc & (qc_hi >= kc_lo)
  return noisy_noisy | noisy_clean | clean_clean


def _ranges(live_BRC, valid_B):
  """int32 [B, R, 8]: per row, the first run of live columns [lo, hi), the valid length, and
  [lo2, hi2) from the next live column to one past the last (0, 0 if none); zeros after (the
  slice kernel keeps its query_start in slot 5).

  Masks of one run (causal, block_causal, documents) leave the second empty; the two-stream
  mask's rows have two runs (a noisy block's own tile, the clean tiles before it), so the noisy
  tiles between them are skipped. Anything past the first run is covered, so it stays exact for
  any live pattern.
  """
  num_cols = live_BRC.shape[-1]
  cols = jnp.arange(num_cols)[None, None, :]
  any_live = live_BRC.any(-1)
  lo = jnp.where(any_live, jnp.argmax(live_BRC, -1), 0)
  gap = ~live_BRC & (cols >= lo[..., None])
  hi = jnp.where(any_live, jnp.where(gap.any(-1), jnp.argmax(gap, -1), num_cols), 0)
  later = live_BRC & (cols >= hi[..., None])
  any_later = later.any(-1)
  lo2 = jnp.where(any_later, jnp.argmax(later, -1), 0)
  hi2 = jnp.where(any_later, num_cols - jnp.argmax(live_BRC[..., ::-1], -1), 0)
  valid = jnp.broadcast_to(valid_B[:, None], lo.shape)
  zero = jnp.zeros_like(lo)
  return jnp.stack([lo, hi, valid, lo2, hi2, zero, zero, zero], -1).astype(jnp.int32)


def _live_loop(range_ref, body, init):
  """body over the row's two runs of live tiles (_ranges)."""
  carry = lax.fori_loop(range_ref[0], range_ref[1], body, init)
  return lax.fori_loop(range_ref[3], range_ref[4], body, carry)


# ---------------------------------------------------------------------------------------------
# Kernels. One program owns one tile of rows of one head of one sequence and loops over the live
# tiles of the other side. Logits are kept in base 2: s = q.k * scale * log2(e).


def _dot(a, b, *, trans_a=False, trans_b=False):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(mask, q0, k0, block_q, block_k, seg_q, seg_k, valid, q_pos=None):
  """Bool [block_q, block_k] tile of the mask starting at query q0 (or at the rows' own
  positions q_pos [block_q, block_k]: the slice kernel's), key k0."""
  if q_pos is None:
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  k_pos = k0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  visible = None

  def both(a, b):
    return b if a is None else a & b

  # Per-document blocks: the grid of the query's document (a key of another one is hidden anyway).
  phase = (seg_q % mask.block_size)[:, None] if mask.per_document else 0
  if mask.kind == 'causal':
    visible = q_pos >= k_pos
  elif mask.kind == 'block_causal':
    visible = (q_pos - phase) // mask.block_size >= (k_pos - phase) // mask.block_size
  elif mask.kind == 'two_stream':
    visible = two_stream_visible(
      q_pos, k_pos, half=mask.half, block_size=mask.block_size, q_offset=phase, k_offset=phase
    )
  if mask.segments:
    visible = both(visible, seg_q[:, None] == seg_k[None, :])
  if mask.lengths:
    visible = both(visible, (stream_index(k_pos, mask.half) if mask.half else k_pos) < valid)
  return visible


def _logits(q, k, scale, mask, q0, k0, seg_q, seg_k, valid, q_pos=None):
  s = _dot(q, k, trans_b=True) * scale
  if mask.dense:
    visible = _visible(mask, q0, k0, q.shape[0], k.shape[0], seg_q, seg_k, valid, q_pos)
    s = jnp.where(visible, s, _NEG)
  return s


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


def _attend(q, v_ref, range_ref, logits, block_k):
  """(output f32 [rows, H], base-2 logsumexp [rows]) of q's rows over the row's live key tiles,
  online softmax; logits(q, key slice, first key) gives a tile's masked base-2 logits. A row
  that sees no key gets output 0 and logsumexp +big (no probability in the backward)."""

  def body(j, carry):
    ks = pl.ds(j * block_k, block_k)
    return _online_step(carry, logits(q, ks, j * block_k), v_ref[ks, :])

  return _online_end(_live_loop(range_ref, body, _online_start(*q.shape)))


def _online_start(rows, head_dim):
  """The online softmax's empty state: (output sum, running max, denominator)."""
  return (
    jnp.zeros((rows, head_dim), jnp.float32),
    jnp.full((rows,), _NEG, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )


def _online_step(carry, s, v):
  """One key tile's base-2 logits s [rows, keys] and values v [keys, H] into the state."""
  acc, m, denom = carry
  m_new = jnp.maximum(m, s.max(-1))
  p = jnp.exp2(s - m_new[:, None])
  alpha = jnp.exp2(m - m_new)
  acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
  return acc, m_new, denom * alpha + p.sum(-1)


def _online_end(carry):
  acc, m, denom = carry
  seen = m > 0.5 * _NEG  # Some key was visible: its logit is far above _NEG.
  denom = jnp.where(seen, denom, 1.0)
  out = jnp.where(seen[:, None], acc / denom[:, None], 0.0)
  return out, jnp.where(seen, m + jnp.log2(denom), -_NEG)


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
# pallas_call wiring and the custom VJP.


def _params(tile, interpret):
  if interpret:
    return {}
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  return dict(
    compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages)
  )


def _rows(block, head):
  """BlockSpec of `block` rows of one head of [B, L, heads, H], grid (row tile, b, head)."""
  return lambda head_dim: pl.BlockSpec(
    (None, block, None, head_dim), lambda i, b, n: (b, i, head(n), 0)
  )


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, seg_BL, valid_B, mask, tiles, interpret):
  return _forward(q, k, v, seg_BL, valid_B, mask, tiles, interpret)[0]


def _flash_fwd(q, k, v, seg_BL, valid_B, mask, tiles, interpret):
  o, lse = _forward(q, k, v, seg_BL, valid_B, mask, tiles, interpret)
  return o, (q, k, v, seg_BL, valid_B, o, lse)


def _flash_bwd(mask, tiles, interpret, res, do):
  q, k, v, seg_BL, valid_B, o, lse = res
  dq, dk, dv = _backward(q, k, v, seg_BL, valid_B, o, lse, do, mask, tiles, interpret)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# A slice of queries against a whole sequence's keys: the sampler's cached decoding step.

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


def _slice_live_tiles(mask, position_R, seg_BR, seg_BS, valid_B, block_r, block_k):
  """Bool [B, row tiles, key tiles]: some row of the tile (query positions position_R) may see
  some key of the key tile."""
  batch, num_keys = seg_BS.shape
  last = position_R.reshape(-1, block_r).max(-1)[:, None]  # a tile's rows may wrap (heads)
  k_first = (jnp.arange(num_keys // block_k) * block_k)[None, :]
  if mask.kind == 'causal':
    live = k_first <= last
  elif mask.kind == 'block_causal' and mask.per_document:  # a grid shifted by < block_size
    live = k_first <= last + mask.block_size - 1
  elif mask.kind == 'block_causal':
    live = k_first // mask.block_size <= last // mask.block_size
  else:
    live = jnp.ones((last.shape[0], k_first.shape[1]), bool)
  live = jnp.broadcast_to(live[None], (batch, *live.shape))
  if mask.lengths:
    live = live & (k_first[None] < valid_B[:, None, None])
  if mask.segments:
    seg_q = seg_BR.reshape(batch, -1, block_r)
    seg_k = seg_BS.reshape(batch, -1, block_k)
    live = live & (
      (seg_k.min(-1)[:, None, :] <= seg_q.max(-1)[:, :, None])
      & (seg_k.max(-1)[:, None, :] >= seg_q.min(-1)[:, :, None])
    )
  return live


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
