"""LLaDA's supervised fine-tuning loss: the prompt stays clean, the response is noised and learnt.

LLaDA GUIDELINES.md / arXiv 2502.09992 App. B.1 (reference dlm_peers.md 1.2): t ~ U[0, 1) per
conversation, p = (1 - eps) t + eps, each response token (the EOS padding included) masked with
probability p, CE of the masked tokens weighted by 1/p and divided by the answer length, summed
over the conversation and averaged over conversations. Its peers differ in exactly three places,
each a switch here: the normalisation (`token`: d1 and dllm's default; `batch`), whether the EOS
padding is supervised (NeMo's `supervise_padding`) and the 1/p weight (dLLM-RL drops it).
block_size > 0 trains a block-diffusion model instead (BD3LM / SDAR SFT): a t per block, the
two-stream forward over [x_t || x_0] (diffusion/loss.py block_loss), the rest unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.data.roles import PADDING, RESPONSE
from dlmjax.diffusion import masking

NORMALISATIONS = ('sequence', 'token', 'batch')
_END_STREAM = 0x43414E56  # fold_in tag of the canvas ends' randomness (random_canvas_ends)


def forward_process(keys_B, tokens_BL, maskable_BL, segments_BL, *, mask_id: int, time_eps: float):
  """LLaDA's forward process on the maskable tokens, with one t per conversation (segment).

  Unlike pre-training (MegaDLMs) there is no at-least-one-mask rule and p is the masking
  probability, not the realised ratio (LLaDA's `forward_process`).

  Returns (noisy [B,L], masked [B,L] bool, p [B,L] float32: each token's conversation's p).
  """
  seq_len = tokens_BL.shape[1]
  num_segments = seq_len + 1  # ids 0 (isolated padding) .. seq_len.

  def one_row(key, tokens_L, maskable_L, segments_L):
    key_t, key_u = jax.random.split(key)
    t_L = jax.random.uniform(key_t, (num_segments,))[segments_L]
    p_L = (1.0 - time_eps) * t_L + time_eps
    masked_L = (jax.random.uniform(key_u, (seq_len,)) < p_L) & maskable_L
    return jnp.where(masked_L, mask_id, tokens_L), masked_L, p_L.astype(jnp.float32)

  return jax.vmap(one_row)(keys_B, tokens_BL, maskable_BL, segments_BL)


def random_canvas_ends(keys_B, roles_BL):
  """(end_B int32, kept_BL bool): each row's canvas cut at a random length, uniform from the end of
  its answer (its first EOS) to the full row, the padding past it hidden from attention.

  EOS-padding every row to model.seq_len lets a bidirectional model place the answer by the
  canvas end instead of the prompt's end; decoding at prompt + gen_length != seq_len then shifts
  or garbles it (a sudoku4 teacher at SFT loss 0.002 solved 1% of its own training puzzles at gen
  32 on canvas 80). LLaDA pads each batch to its longest row only, so its canvas ends vary; a
  random end per row does that for any data. The keys are the forward process's, folded apart.
  """
  length = roles_BL.shape[1]
  answered_B = jnp.sum(roles_BL != PADDING, axis=1).astype(jnp.int32)
  keys_B = jax.vmap(lambda k: jax.random.fold_in(k, _END_STREAM))(keys_B)
  end_B = jax.vmap(lambda k, low: jax.random.randint(k, (), low, length + 1))(keys_B, answered_B)
  return end_B, jnp.arange(length)[None] < end_B[:, None]


def answer_lengths(maskable_BL, segments_BL):
  """Each token's conversation's number of maskable tokens (LLaDA's answer length)."""
  num_segments = segments_BL.shape[1] + 1

  def one_row(maskable_L, segments_L):
    return jax.ops.segment_sum(maskable_L.astype(jnp.float32), segments_L, num_segments)[segments_L]

  return jax.vmap(one_row)(maskable_BL, segments_BL)


def sft_loss(
  ce_fn,
  tokens_BS,
  *,
  roles,
  seed,
  step,
  micro_index,
  example_ids_B,
  mask_id,
  normalisation='sequence',
  supervise_padding=True,
  weight_by_inverse_t=True,
  time_eps=1e-3,
  segment_ids=None,
  block_size=0,
):
  """The SFT loss of rows [B, S+1] (the first S tokens are the canvas, as in pre-training).

  roles [B, S+1]: PROMPT | RESPONSE (the answer and its EOS) | PADDING (EOS after it).
  segment_ids [B, S+1] (data.packing): 1-based conversation ids; attention, positions and t stay
  inside each conversation. Padding that is not supervised is hidden from attention as well, so
  the model never sees how long the answer is; supervised padding of unpacked rows runs to a
  random end per row (random_canvas_ends), so the model never learns where the canvas ends.

  Per token: c = CE * masked * (1/p if weight_by_inverse_t else 1). With n_c the maskable tokens
  of token's conversation and N the conversations: `sequence` sum(c / n_c) / N (LLaDA),
  `token` sum(c) / sum(maskable), `batch` sum(c) / N. Returns (objective, sums).
  block_size > 0: t per block (masking.block_forward_process, its eps = time_eps; with
  segment_ids the blocks count from each conversation's start) and
  the model reads [x_t || x_0] (its clean_BL); `token` is SDAR's normalisation.
  """
  del micro_index
  if normalisation not in NORMALISATIONS:
    raise ValueError(f'normalisation {normalisation!r} is not one of {NORMALISATIONS}.')
  x_BL, roles_BL = tokens_BS[:, :-1], roles[:, :-1]
  padding_BL = roles_BL == PADDING
  maskable_BL = (roles_BL == RESPONSE) | (padding_BL & supervise_padding)
  hidden_BL = padding_BL & (not supervise_padding)
  keys = masking.example_keys(seed, step, example_ids_B)
  if segment_ids is None:
    segments_BL = jnp.ones_like(x_BL)
    if not supervise_padding:  # padding is the tail: the canvas ends with the answer.
      model_kwargs = dict(valid_length_B=jnp.sum(~padding_BL, axis=1).astype(jnp.int32))
    elif block_size:  # block-causal: no block before the last sees where the canvas ends.
      model_kwargs = {}
    else:
      end_B, kept_BL = random_canvas_ends(keys, roles_BL)
      maskable_BL = maskable_BL & kept_BL
      model_kwargs = dict(valid_length_B=end_B)
  else:
    segments_BL = jnp.where(hidden_BL, 0, segment_ids[:, :-1])
    model_kwargs = dict(
      segment_ids_BL=segments_BL, positions_BL=masking.segment_positions(segments_BL)
    )
  if block_size:
    noisy_BL, masked_BL, p_BL = masking.block_forward_process(
      keys,
      x_BL,
      maskable_BL,
      block_size=block_size,
      mask_id=mask_id,
      eps=time_eps,
      segment_ids_BL=None if segment_ids is None else segments_BL,
    )
    model_kwargs['clean_BL'] = x_BL
  else:
    noisy_BL, masked_BL, p_BL = forward_process(
      keys, x_BL, maskable_BL, segments_BL, mask_id=mask_id, time_eps=time_eps
    )
  ce_BL = ce_fn(noisy_BL, x_BL, **model_kwargs)
  masked = masked_BL.astype(jnp.float32)
  maskable = maskable_BL.astype(jnp.float32)
  contribution_BL = ce_BL * masked / p_BL if weight_by_inverse_t else ce_BL * masked
  length_BL = jnp.maximum(answer_lengths(maskable_BL, segments_BL), 1.0)
  conversations = jnp.sum(maskable / length_BL)  # each conversation's tokens add up to 1.
  if normalisation == 'sequence':
    num, den = jnp.sum(contribution_BL / length_BL), conversations
  elif normalisation == 'token':
    num, den = jnp.sum(contribution_BL), jnp.sum(maskable)
  else:
    num, den = jnp.sum(contribution_BL), conversations
  den = jnp.maximum(den, 1e-9)  # only an all-prompt micro-batch has none.
  batch, length = x_BL.shape
  sums = dict(
    loss_num=num,
    loss_den=den,
    masked_ce_sum=jnp.sum(ce_BL * masked),
    masked_count=jnp.sum(masked),
    maskable_count=jnp.sum(maskable),
    conversations=conversations,
    tokens=jnp.float32(batch * length),
  )
  return num / den, sums


def metrics(sums) -> dict:
  """Step metrics from the sums of the micro-batches."""
  return dict(
    loss=sums['loss_num'] / sums['loss_den'],
    masked_ce=sums['masked_ce_sum'] / jnp.maximum(sums['masked_count'], 1.0),
    mask_ratio=sums['masked_count'] / jnp.maximum(sums['maskable_count'], 1.0),
    response_tokens=sums['maskable_count'],
    conversations=sums['conversations'],
    tokens=sums['tokens'],
  )
