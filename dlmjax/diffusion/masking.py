"""The forward (masking) process of masked diffusion, with randomness derived from example ids.

Every random draw is a pure function of (seed, step, example index) or (seed, step, micro-batch
index), never of the device layout, so every mesh and a resumed run see the same masks. MegaDLMs
instead seeds a per-rank torch generator and restarts it on resume (reference section 1.8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.kernels import flash_attention

# Stream tags keep the per-example and per-micro-batch key families apart.
_EXAMPLE_STREAM = 0
_VARLEN_STREAM = 1


def example_keys(seed: int, step, example_ids_B):
  """One key per example: fold_in(seed, stream, step, global example index)."""
  base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _EXAMPLE_STREAM), step)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(example_ids_B)


def varlen_length(seed: int, step, micro_index, *, seq_len: int, prob: float):
  """Tokens kept in this micro-batch: seq_len, or U{1..seq_len} with probability `prob`.

  MegaDLMs truncates 1% of micro-batches to one random length shared by the micro-batch and
  identical on all ranks (reference 1.3). It draws r in [2, S] and then drops a token by the
  unshift; we train on all S tokens, so the kept length is uniform in [1, S] (as LLaDA).
  """
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _VARLEN_STREAM), step)
  key_u, key_r = jax.random.split(jax.random.fold_in(key, micro_index))
  truncate = jax.random.uniform(key_u) < prob
  length = jax.random.randint(key_r, (), 1, seq_len + 1)
  return jnp.where(truncate, length, seq_len).astype(jnp.int32)


def forward_process(keys_B, tokens_BL, *, mask_id: int, length):
  """MegaDLMs' difflm_forward_process on the first `length` tokens of each row.

  t ~ U[0,1) per row; each token masked with probability t; a row with no mask gets one at a
  uniform position; p = realised mask ratio n/l (not t, and no eps floor).

  Returns (noisy tokens [B,L], masked [B,L] bool, p [B] float32). Positions >= length are never
  masked (they are padding of a truncated micro-batch).
  """
  seq_len = tokens_BL.shape[1]
  valid_L = jnp.arange(seq_len) < length

  def one_row(key, tokens_L):
    key_t, key_u, key_pos = jax.random.split(key, 3)
    t = jax.random.uniform(key_t)
    masked_L = (jax.random.uniform(key_u, (seq_len,)) < t) & valid_L
    forced = jax.random.randint(key_pos, (), 0, length)
    masked_L = jnp.where(masked_L.any(), masked_L, jnp.arange(seq_len) == forced)
    p = masked_L.sum() / length
    return jnp.where(masked_L, mask_id, tokens_L), masked_L, p.astype(jnp.float32)

  return jax.vmap(one_row)(keys_B, tokens_BL)


def forward_process_segments(keys_B, tokens_BL, segment_ids_BL, *, mask_id: int, length):
  """forward_process per document of packed rows (segment ids: 1-based, non-decreasing per row).

  t ~ U[0,1) per document; the at-least-one-mask rule and p = n/l apply per document (l counts
  the document's tokens before `length`). This fixes MegaDLMs' THD packing, which draws one t
  for the whole packed micro-batch and takes p over all of it (reference 3.6 (b), section 8.6).

  Returns (noisy tokens [B,L], masked [B,L] bool, p [B,L] float32: each token's document ratio).
  """
  seq_len = tokens_BL.shape[1]
  valid_L = jnp.arange(seq_len) < length
  num_segments = seq_len + 1  # ids are 1-based and a row holds at most seq_len documents.

  def one_row(key, tokens_L, segments_L):
    key_t, key_u, key_pos = jax.random.split(key, 3)

    def document_total(x_L):  # each token gets the sum of x over its document
      return jax.ops.segment_sum(x_L, segments_L, num_segments)[segments_L]

    t_L = jax.random.uniform(key_t, (num_segments,))[segments_L]
    masked_L = (jax.random.uniform(key_u, (seq_len,)) < t_L) & valid_L
    # A document with no mask gets one at a uniform position: the highest of distinct random
    # ranks among its valid tokens.
    rank_L = jnp.where(valid_L, jax.random.permutation(key_pos, seq_len), -1)
    top_L = jax.ops.segment_max(rank_L, segments_L, num_segments)[segments_L]
    unmasked_L = document_total(masked_L.astype(jnp.int32)) == 0
    masked_L = masked_L | (valid_L & unmasked_L & (rank_L == top_L))
    count_L = document_total(masked_L.astype(jnp.float32))
    tokens_in_doc_L = document_total(valid_L.astype(jnp.float32))
    p_L = jnp.where(valid_L, count_L / jnp.maximum(tokens_in_doc_L, 1.0), 1.0)
    return jnp.where(masked_L, mask_id, tokens_L), masked_L, p_L.astype(jnp.float32)

  return jax.vmap(one_row)(keys_B, tokens_BL, segment_ids_BL)


def segment_positions(segment_ids_BL):
  """Positions restarting at 0 where each segment starts (RoPE per document)."""
  index_1L = jnp.arange(segment_ids_BL.shape[1])[None]
  return index_1L - flash_attention.document_starts(segment_ids_BL)


def block_forward_process(
  keys_B, tokens_BL, maskable_BL, *, block_size: int, mask_id: int, eps, segment_ids_BL=None
):
  """BD3LM's forward process: one noise level per block of `block_size` tokens.

  Blocks count from the row's start, or with segment_ids_BL (packed documents) from each
  document's start, as the block-causal and two-stream masks count them then (SDAR aligns blocks
  to each packed sample; docs/block_diffusion.md, Packed documents): a document's last block may
  be short. t = (1 - eps) u + eps, the range [eps, 1] of BD3LM's sampling_eps_min / max defaults
  (1e-3, 1; its variance-minimising search over clipped ranges is not done here). The u of a
  row's n blocks are stratified (BD3LM's antithetic sampling, here within each row so every draw
  stays a function of its example's key): block j gets u = (pi_j + v_j) / n for a random
  permutation pi of the n blocks and v ~ U[0, 1), so each block's t is uniform and the row covers
  the range evenly. Each maskable token is masked with probability t (no at-least-one rule: p is
  the probability, not the ratio).

  Returns (noisy [B,L], masked [B,L] bool, p [B,L] float32: each token's block's t).
  """
  seq_len = tokens_BL.shape[1]
  if segment_ids_BL is None:
    num_slots = -(-seq_len // block_size)  # the row's blocks
    positions_BL = jnp.broadcast_to(jnp.arange(seq_len), tokens_BL.shape)
  else:
    num_slots = seq_len  # at most one block per token (documents of one token)
    positions_BL = segment_positions(segment_ids_BL)
  # Each token's block: a block starts at every block_size-th position of its document.
  block_BL = jnp.cumsum(positions_BL % block_size == 0, axis=1) - 1

  def one_row(key, tokens_L, maskable_L, block_L):
    key_perm, key_v, key_u = jax.random.split(key, 3)
    num_blocks = block_L[-1] + 1
    slots = jnp.arange(num_slots)
    order = jnp.where(slots < num_blocks, jax.random.permutation(key_perm, num_slots), num_slots)
    strata = jnp.argsort(jnp.argsort(order))  # a permutation of the first num_blocks slots
    u_N = (strata + jax.random.uniform(key_v, (num_slots,))) / num_blocks
    t_L = ((1.0 - eps) * u_N + eps)[block_L]
    masked_L = (jax.random.uniform(key_u, (seq_len,)) < t_L) & maskable_L
    return jnp.where(masked_L, mask_id, tokens_L), masked_L, t_L.astype(jnp.float32)

  return jax.vmap(one_row)(keys_B, tokens_BL, maskable_BL, block_BL)
