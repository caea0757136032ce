"""d3LLM's entropy-based multi-block decoding (arXiv 2601.07568; hao-ai-lab/d3LLM
`generate_multi_block`): several blocks decode at once, each opened once the one before it is
partly decoded.

Per row, blocks of block_length open left to right. Each step the next block opens when the
last open one has progress (1 - its masks / block_length) of at least block_add_threshold. One
forward over the whole canvas then scores every masked token of the open blocks by the entropy
of its prediction; the lowest-entropy one commits, and so does every other with entropy at most
sampler.entropy_threshold (dParallel's rule). If the first fully active block with masks
committed nothing, its lowest-entropy token commits too. A row is done once every block is open
and decoded; each step commits at least one token, so gen_length steps bound the loop.

d3LLM's decoded_token_threshold is not a setting here: in its uncached loop a block's "fully
activated" flag (its predecessor's progress at least that threshold) only chooses the block of
forced progress, the first activated block with masks, and that is always the first block with
masks (every block before it is decoded, progress 1), whatever the threshold; the test runs
d3LLM's loop at two thresholds against one result.

Differences from d3LLM's loop: batched (each row keeps its own blocks; d3LLM's runs one prompt);
entropy in float32 (d3LLM: float64); no EOS early stop; MASK and padded vocabulary rows are never
predicted (the sampler's canvas.guided). Only the uncached forward (cache 'none') is built: d3LLM's
cached variant keeps a K/V prefix that grows block by block with a delay, which is not one of the
fixed-block cache modes (docs/differences.md, Decoding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import canvas as canvas_lib
from dlmjax.diffusion import decoding


def block_masks(x_BL, canvas, mask_id: int):
  """int32 [B, N]: the masked tokens in each completion block."""
  gen = canvas.num_blocks * canvas.block
  region_BL = jax.lax.dynamic_slice_in_dim(x_BL, canvas.prefill, gen, axis=1)
  return jnp.sum(region_BL.reshape(x_BL.shape[0], canvas.num_blocks, canvas.block) == mask_id, -1)


def open_blocks(opened_B, masks_BN, block: int, sampling):
  """opened_B after one step's opening: one more block once the last open one has progress
  (1 - masks / block_length) of at least block_add_threshold (d3LLM also opens one when the last
  has no masks left: progress 1, implied as the threshold is at most 1)."""
  last_B = jnp.maximum(opened_B - 1, 0)
  last_masks_B = jnp.take_along_axis(masks_BN, last_B[:, None], 1)[:, 0]
  add_B = (opened_B < masks_BN.shape[1]) & (
    1.0 - last_masks_B / block >= sampling.block_add_threshold
  )
  return opened_B + add_B.astype(jnp.int32)


def commits(logits_BGV, x_BG, opened_B, block: int, sampling, noise_key, mask_id: int):
  """(new completion tokens [B, G], the positions committed [B, G]) of one step over the
  completion region G = N * block, from its logits (canvas.guided's: MASK in them only with
  mask_in_softmax, where the entropy counts it but no prediction is MASK)."""
  batch, gen = x_BG.shape
  masked_BG = x_BG == mask_id
  block_1G = jnp.arange(gen)[None] // block
  candidate_BG = masked_BG & (block_1G < opened_B[:, None])
  predictable_BGV = jnp.where(jnp.arange(logits_BGV.shape[-1]) == mask_id, -jnp.inf, logits_BGV)
  x0_BG = decoding.sample_tokens(predictable_BGV, noise_key, sampling.temperature)
  entropy_BG = jnp.where(candidate_BG, decoding.entropy(logits_BGV), jnp.inf)
  best_BG = jnp.arange(gen)[None] == jnp.argmin(entropy_BG, axis=1)[:, None]
  commit_BG = candidate_BG & (best_BG | (entropy_BG <= sampling.entropy_threshold))
  # Forced progress in the first fully active block with masks: the first block with masks (all
  # before it are decoded, so it is fully active whatever decoded_token_threshold is).
  masks_BN = jnp.sum(masked_BG.reshape(batch, -1, block), -1)
  open_BN = jnp.arange(masks_BN.shape[1])[None] < opened_B[:, None]
  first_active_B = jnp.argmax(open_BN & (masks_BN > 0), axis=1)
  has_first_B = jnp.any(open_BN & (masks_BN > 0), axis=1)
  in_first_BG = (block_1G == first_active_B[:, None]) & has_first_B[:, None]
  stalled_B = ~jnp.any(commit_BG & in_first_BG, axis=1)
  first_entropy_BG = jnp.where(in_first_BG & masked_BG, entropy_BG, jnp.inf)
  forced_BG = jnp.arange(gen)[None] == jnp.argmin(first_entropy_BG, axis=1)[:, None]
  forced_BG = forced_BG & (stalled_B & has_first_B)[:, None]
  x0_BG = jnp.where(forced_BG, jnp.argmax(predictable_BGV, -1), x0_BG)  # d3LLM: its argmax
  commit_BG = commit_BG | forced_BG
  return jnp.where(commit_BG, x0_BG, x_BG), commit_BG


def decode(canvas, sampling, key, *, mask_id: int):
  """(x_BL decoded, steps_BL: the step that committed each canvas token or -1, the step count)."""
  if canvas_lib.block_grid(canvas.module.cfg) > 1:
    raise ValueError(
      'multi-block decoding (sampler.block_add_threshold > 0) is built for models whose rows all '
      'start their completion at one position; a block-causal model aligns each row to its own '
      'grid: set block_add_threshold=0 (and use cache=block).'
    )
  block, num_blocks, start = canvas.block, canvas.num_blocks, canvas.prefill
  gen = num_blocks * block
  batch = canvas.batch

  def unfinished(carry):
    step, x_BL, _, opened_B = carry
    left = jnp.any(block_masks(x_BL, canvas, mask_id) > 0) | jnp.any(opened_B < num_blocks)
    return left & (step < gen)

  def body(carry):
    step, x_BL, steps_BL, opened_B = carry
    opened_B = open_blocks(opened_B, block_masks(x_BL, canvas, mask_id), block, sampling)
    logits_BGV = canvas.guided(canvas.hidden(x_BL), start, gen)
    x_BG = jax.lax.dynamic_slice_in_dim(x_BL, start, gen, axis=1)
    noise_key = jax.random.fold_in(key, step)
    new_BG, commit_BG = commits(logits_BGV, x_BG, opened_B, block, sampling, noise_key, mask_id)
    x_BL = jax.lax.dynamic_update_slice_in_dim(x_BL, new_BG, start, axis=1)
    steps_BG = jax.lax.dynamic_slice_in_dim(steps_BL, start, gen, axis=1)
    steps_BG = jnp.where(commit_BG, step, steps_BG)
    steps_BL = jax.lax.dynamic_update_slice_in_dim(steps_BL, steps_BG, start, axis=1)
    return step + 1, x_BL, steps_BL, opened_B

  carry = (
    jnp.int32(0),
    canvas.x_BL,
    jnp.full((batch, canvas.length), -1, jnp.int32),
    jnp.ones((batch,), jnp.int32),
  )
  step, x_BL, steps_BL, _ = jax.lax.while_loop(unfinished, body, carry)
  return x_BL, steps_BL, step
