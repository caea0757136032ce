"""The flash kernels' mask: the rule itself, one tile of it, and which tiles it leaves live.

The rule (two_stream_visible, the document helpers) is shared with the XLA reference
(model/attention.py); _visible is one [block_q, block_k] tile of it inside a kernel; the live
tiles and their runs (_ranges) are computed once per call in plain JAX, and the kernels loop over
those runs only (flash_blocks._live_loop).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

MASK_KINDS = ('bidirectional', 'causal', 'block_causal', 'two_stream')


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
  an earlier one (two_stream_visible, above).
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


# ---------------------------------------------------------------------------------------------
# One tile of the mask, inside a kernel.


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
