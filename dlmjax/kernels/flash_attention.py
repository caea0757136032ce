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

Modules: flash_masks (the mask, its tiles, which tiles are live), flash_blocks (the pieces every
kernel shares: tiles, logits, online softmax), flash_fwd_bwd (the training kernel's forward and
backward programs), flash_slice (the sampler's forward-only slice kernels). This module is the
entry point callers import: flash_attention and its custom VJP, and the names callers use.
Underscored names are private to these flash_* modules together, not to one file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dlmjax.kernels.flash_blocks import Tile, Tiles, supports_head_dim
from dlmjax.kernels.flash_fwd_bwd import _backward, _forward
from dlmjax.kernels.flash_masks import (
  MASK_KINDS,
  _Mask,
  document_keys,
  document_starts,
  stream_index,
  two_stream_visible,
)
from dlmjax.kernels.flash_slice import (
  SLICE_KINDS,
  SLICE_TILE,
  flash_attention_slice,
  flash_attention_slice_cached,
)

__all__ = [
  'MASK_KINDS',
  'SLICE_KINDS',
  'SLICE_TILE',
  'Tile',
  'Tiles',
  'document_keys',
  'document_starts',
  'flash_attention',
  'flash_attention_slice',
  'flash_attention_slice_cached',
  'stream_index',
  'supports_head_dim',
  'two_stream_visible',
]


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
# The custom VJP around the training kernel (flash_fwd_bwd).


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
