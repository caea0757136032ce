"""What every flash kernel is built from: tile sizes, masked base-2 logits, the online softmax,
the loop over a row's live tiles, and Triton's compiler parameters.

One program owns one tile of rows of one head of one sequence and loops over the live tiles of
the other side. Logits are kept in base 2: s = q.k * scale * log2(e).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dlmjax.kernels.flash_masks import _visible

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


def supports_head_dim(head_dim: int) -> bool:
  """Triton tiles are powers of two, and its matmuls need at least 16 columns."""
  return head_dim >= 16 and not head_dim & (head_dim - 1)


def _live_loop(range_ref, body, init):
  """body over the row's two runs of live tiles (_ranges)."""
  carry = lax.fori_loop(range_ref[0], range_ref[1], body, init)
  return lax.fori_loop(range_ref[3], range_ref[4], body, carry)


def _dot(a, b, *, trans_a=False, trans_b=False):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _logits(q, k, scale, mask, q0, k0, seg_q, seg_k, valid, q_pos=None):
  s = _dot(q, k, trans_b=True) * scale
  if mask.dense:
    visible = _visible(mask, q0, k0, q.shape[0], k.shape[0], seg_q, seg_k, valid, q_pos)
    s = jnp.where(visible, s, _NEG)
  return s


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


def _params(tile, interpret):
  if interpret:
    return {}
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  return dict(
    compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages)
  )
