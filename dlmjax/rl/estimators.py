"""Log-likelihood estimates of a completion under a masked DLM: d1's one-step token estimate,
DiffuCoder's coupled (complementary-mask) token estimate, TraceRL's trajectory token estimate
(block-causal models), ESPO's sequence ELBO, and SPG's ELBO / EUBO pair from block-wise masks.

Rows are right-padded: prompt [0, prompt_len), the completion canvas [prompt_len, length), pads
after (no valid token attends to them). Every mask derives from (seed, mask_seed) per row, so
the policy, the old policy and the reference see the same masks within one inner iteration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dlmjax.diffusion import likelihood
from dlmjax.diffusion import loss as loss_lib

_RL_STREAM = 7  # keeps RL masks apart from the pre-training mask streams (masking.py)


def row_keys(seed, mask_seeds_B):
  """Each row's mask key; `seed` is the run's seed or its key, jax.random.key(seed), which a
  program takes as an argument so that it compiles once for every seed."""
  is_key = isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
  base = jax.random.fold_in(seed if is_key else jax.random.key(seed), _RL_STREAM)
  return jax.vmap(lambda s: jax.random.fold_in(base, s))(mask_seeds_B)


def d1_token_logprobs(
  module,
  tokens_BL,
  prompt_lengths_B,
  lengths_B,
  mask_seeds_B,
  *,
  seed: int,
  mask_id: int,
  p_mask_prompt: float,
  chunk_size: int = 0,
):
  """d1's one-step estimate: log p(o_k | prompt with each token masked w.p. p_mask_prompt, all
  completion tokens masked) for every completion position k; [B, L], 0 outside the completion."""
  completion_BL, prompt_masked_BL = _one_step_masks(
    tokens_BL, prompt_lengths_B, lengths_B, row_keys(seed, mask_seeds_B), p_mask_prompt
  )
  noisy_BL = jnp.where(completion_BL | prompt_masked_BL, mask_id, tokens_BL)
  ce_BL = loss_lib.model_cross_entropy(
    module, noisy_BL, tokens_BL, chunk_size=chunk_size, valid_length_B=lengths_B
  )
  return jnp.where(completion_BL, -ce_BL, 0.0)


def _one_step_masks(tokens_BL, prompt_lengths_B, lengths_B, keys_B, p_mask_prompt: float):
  """(the completion canvas [B, L], the prompt tokens masked w.p. p_mask_prompt [B, L])."""
  positions_1L = jnp.arange(tokens_BL.shape[1])[None]
  prompt_BL = positions_1L < prompt_lengths_B[:, None]
  completion_BL = ~prompt_BL & (positions_1L < lengths_B[:, None])
  uniform_BL = jax.vmap(lambda k: jax.random.uniform(k, tokens_BL.shape[1:]))(keys_B)
  return completion_BL, prompt_BL & (uniform_BL < p_mask_prompt)


def trajectory_ranks(steps_BL, completion_BL, block_size: int):
  """int32 [B, L]: each completion token's round, the rank of its commit step among the distinct
  commit steps of its model block (blocks of block_size from position 0; 0 = the block's first
  step). A token never committed (step < 0: left masked after the text ended) ranks last."""
  batch, length = steps_BL.shape
  padded = -(-length // block_size) * block_size
  big = jnp.iinfo(jnp.int32).max
  steps = jnp.where(steps_BL < 0, big, steps_BL)
  pad = ((0, 0), (0, padded - length))
  s_BNK = jnp.pad(steps, pad).reshape(batch, -1, block_size)
  valid_BNK = jnp.pad(completion_BL, pad).reshape(batch, -1, block_size)
  same = s_BNK[..., :, None] == s_BNK[..., None, :]  # [B, N, k, k']
  earlier = (jnp.arange(block_size)[None, :] < jnp.arange(block_size)[:, None])[None, None]
  repeat = jnp.any(same & earlier & valid_BNK[..., None, :], axis=-1)
  first_BNK = valid_BNK & ~repeat  # one token per distinct step
  below = first_BNK[..., None, :] & (s_BNK[..., None, :] < s_BNK[..., :, None])
  return below.sum(-1).reshape(batch, padded)[:, :length].astype(jnp.int32)


def trace_token_logprobs(
  module,
  tokens_BL,
  prompt_lengths_B,
  lengths_B,
  steps_BL,
  *,
  block_size: int,
  rounds: int,
  mask_id: int,
  chunk_size: int = 0,
):
  """TraceRL's trajectory-aware token estimate for a block-causal model (arXiv 2509.06949;
  Gen-Verse/dLLM-RL train/rl_sdar.py, method TraceRL with shrink 1): log p(o_k | the state the
  sampler was in when it committed o_k); [B, L], 0 outside the completion and on tokens no step
  committed.

  steps_BL: the step that committed each completion token (the sampler's trajectory, -1 where
  none did). In round r, every model block is at its r-th distinct commit step: its tokens
  committed at that step or later are masked, the earlier ones clean, and the round scores the
  tokens committed at that step. One two-stream forward per round ([x_t || x_0], the block
  objective's): a noisy block sees itself and the clean blocks before it, which is the sampler's
  state exactly when it decodes one model block at a time (sampler.block_length ==
  model.block_size, checked by the config) with earlier blocks committed. `rounds` bounds the
  distinct steps of a block (min(block_size, steps per block)); all rounds run in one batch.
  """
  positions_1L = jnp.arange(tokens_BL.shape[1])[None]
  completion_BL = (positions_1L >= prompt_lengths_B[:, None]) & (positions_1L < lengths_B[:, None])
  rank_BL = trajectory_ranks(steps_BL, completion_BL, block_size)
  noisy = jnp.concatenate(
    [jnp.where(completion_BL & (rank_BL >= r), mask_id, tokens_BL) for r in range(rounds)]
  )
  tile = lambda x: jnp.concatenate([x] * rounds)  # noqa: E731  rows r*B + b
  ce = loss_lib.model_cross_entropy(
    module,
    noisy,
    tile(tokens_BL),
    chunk_size=chunk_size,
    valid_length_B=tile(lengths_B),
    clean_BL=tile(tokens_BL),
  )
  logp_RBL = -ce.reshape(rounds, *tokens_BL.shape)
  committed_BL = completion_BL & (steps_BL >= 0)  # an uncommitted token took no action
  scored_RBL = committed_BL[None] & (rank_BL[None] == jnp.arange(rounds)[:, None, None])
  return jnp.sum(jnp.where(scored_RBL, logp_RBL, 0.0), axis=0)


def stepwise_logprobs(
  module, tokens_BL, targets_BL, completion_mask_BL, lengths_B, *, mask_id: int, chunk_size=0
):
  """wd1++'s log pi(x_0|l | x_l, q) [B]: tokens_BL is the state x_l (MASK where the sampler had
  not committed yet), targets_BL the step's predicted completion; the sum of log p(target) over
  the positions masked in x_l and inside the prediction's completion (up to and incl. its first
  EOS), from one forward of x_l (DCE's term without its 1 / t, which the loss weight carries)."""
  ce_BL = loss_lib.model_cross_entropy(
    module, tokens_BL, targets_BL, chunk_size=chunk_size, valid_length_B=lengths_B
  )
  scored_BL = (tokens_BL == mask_id) & (completion_mask_BL > 0)
  return jnp.sum(jnp.where(scored_BL, -ce_BL, 0.0), axis=1)


COUPLED_T_RANGE = (0.2, 0.8)  # DiffuCoder's forward_process: mask_ratio = random.uniform(0.2, 0.8)


def coupled_token_logprobs(
  module,
  tokens_BL,
  prompt_lengths_B,
  lengths_B,
  mask_seeds_B,
  *,
  seed: int,
  mask_id: int,
  p_mask_prompt: float,
  chunk_size: int = 0,
):
  """Coupled-GRPO's token estimate (DiffuCoder, arXiv 2506.20639; apple/ml-diffucoder
  src/open_r1/coupled_grpo.py, forward_process and selective_log_softmax); [B, L], 0 outside
  the completion.

  Three views of each row: (0) every completion token masked; (1) each masked where u_k < t,
  t ~ U[0.2, 0.8]; (2) the complement, masked where u_k >= t. So (1) and (2) mask every
  completion token exactly once between them. Per token
      logp_k = (logp0_k + [k masked in (1)] logp1_k / t + [k masked in (2)] logp2_k / (1 - t)) / 2.
  One t per row (DiffuCoder draws one per batch and mask seed). Prompt tokens are masked w.p.
  p_mask_prompt in all three views alike (DiffuCoder masks none: p_mask_prompt = 0).
  """
  completion_BL, prompt_masked_BL, first_BL, t_B = coupled_masks(
    tokens_BL, prompt_lengths_B, lengths_B, row_keys(seed, mask_seeds_B), p_mask_prompt
  )
  second_BL = completion_BL & ~first_BL
  views = [completion_BL, first_BL, second_BL]
  noisy = jnp.concatenate([jnp.where(m | prompt_masked_BL, mask_id, tokens_BL) for m in views])
  tile = lambda x: jnp.concatenate([x] * 3)  # noqa: E731  rows v*B + b
  ce = loss_lib.model_cross_entropy(
    module, noisy, tile(tokens_BL), chunk_size=chunk_size, valid_length_B=tile(lengths_B)
  )
  full_BL, logp1_BL, logp2_BL = jnp.split(-ce, 3)
  t_B1 = t_B[:, None]
  coupled_BL = jnp.where(first_BL, logp1_BL / t_B1, logp2_BL / (1.0 - t_B1))
  return jnp.where(completion_BL, (full_BL + coupled_BL) / 2.0, 0.0)


def coupled_masks(tokens_BL, prompt_lengths_B, lengths_B, keys_B, p_mask_prompt: float):
  """Coupled-GRPO's draws per row: (completion canvas, masked prompt tokens, view (1)'s masked
  completion tokens where u_k < t [B, L], t [B]); view (2) masks the rest of the completion."""
  completion_BL, prompt_masked_BL = _one_step_masks(
    tokens_BL, prompt_lengths_B, lengths_B, keys_B, p_mask_prompt
  )
  low, high = COUPLED_T_RANGE
  t_B = jax.vmap(
    lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (), minval=low, maxval=high)
  )(keys_B)
  u_BL = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 2), tokens_BL.shape[1:]))(
    keys_B
  )
  return completion_BL, prompt_masked_BL, completion_BL & (u_BL < t_B[:, None]), t_B


def sequence_elbo(
  module,
  tokens_BL,
  prompt_lengths_B,
  lengths_B,
  mask_seeds_B,
  *,
  seed: int,
  mask_id: int,
  num_samples: int,
  chunk_size: int = 0,
):
  """ESPO's sequence log-likelihood: LLaDA's low-variance ELBO of the completion given the
  prompt (dlmjax.diffusion.likelihood) with num_samples stratified mask counts; [B]."""
  settings = likelihood.LikelihoodConfig(
    mc_num=num_samples, mc_batch=num_samples, chunk_tokens=chunk_size
  )
  return likelihood.log_likelihood(
    module,
    tokens_BL,
    prompt_lengths_B,
    lengths_B,
    row_keys(seed, mask_seeds_B),
    settings,
    mask_id=mask_id,
  )


def spg_block_masks(
  key, prompt_length, completion_length, width: int, *, block_length: int, p_mask_prompt: float
):
  """SPG's block-wise mask for one row and MC sample: [width] bool, True = masked.

  A block of the completion is drawn uniformly (blocks of block_length from the prompt's end);
  earlier blocks stay clean, every later position is masked, and inside the block a uniform
  number in [1, its completion tokens] of them is masked at random. Canvas positions after the
  completion (after its first EOS) are always masked; prompt tokens w.p. p_mask_prompt (SPG's
  code applies that rate to the clean completion tokens of earlier blocks too; here, as in d1,
  it masks prompt tokens only). Each sample draws its block independently (SPG's code draws
  distinct blocks, so it needs samples <= blocks).
  """
  block_key, count_key, order_key, prompt_key = jax.random.split(key, 4)
  positions = jnp.arange(width)
  num_blocks = (completion_length + block_length - 1) // block_length
  block = jax.random.randint(block_key, (), 0, num_blocks)
  start = prompt_length + block * block_length
  in_block = jnp.minimum(block_length, completion_length - block * block_length)
  count = jax.random.randint(count_key, (), 1, in_block + 1)
  window = (positions >= start) & (positions < start + in_block)
  order = jnp.where(window, jax.random.uniform(order_key, (width,)), 2.0)
  rank = jnp.argsort(jnp.argsort(order))  # the window's positions come first, in random order
  masked = (
    (window & (rank < count))
    | (positions >= start + block_length)
    | (positions >= prompt_length + completion_length)
  )  # none of these reach the prompt
  in_prompt = positions < prompt_length
  return masked | (in_prompt & (jax.random.uniform(prompt_key, (width,)) < p_mask_prompt))


def spg_sequence_bounds(
  module,
  tokens_BL,
  prompt_lengths_B,
  lengths_B,
  completion_mask_BL,
  mask_seeds_B,
  *,
  seed: int,
  mask_id: int,
  num_samples: int,
  block_length: int,
  p_mask_prompt: float,
  eubo_beta: float,
  chunk_size: int = 0,
):
  """SPG's two bounds on log pi(completion | prompt) from num_samples block-wise masks; ([B], [B]).

  ELBO: per sample, the mean log-prob of the masked completion tokens, averaged over samples.
  EUBO (Renyi, beta = eubo_beta): per token, the sample mean of p^beta * masked / t_hat (t_hat the
  sample's masked share of the completion); then the mean log of that over the tokens masked in
  some sample, divided by beta. The completion runs up to and including its first EOS.
  """
  batch, width = tokens_BL.shape
  completion_lengths_B = completion_mask_BL.sum(axis=1).astype(jnp.int32)
  keys_BS = jax.vmap(lambda k: jax.random.split(k, num_samples))(row_keys(seed, mask_seeds_B))
  make = functools.partial(
    spg_block_masks, width=width, block_length=block_length, p_mask_prompt=p_mask_prompt
  )
  masked_BSL = jax.vmap(lambda ks, p, c: jax.vmap(lambda k: make(k, p, c))(ks))(
    keys_BS, prompt_lengths_B, completion_lengths_B
  )
  tile = lambda x: jnp.repeat(x, num_samples, axis=0)  # noqa: E731  rows b*S + s
  noisy = jnp.where(masked_BSL.reshape(batch * num_samples, width), mask_id, tile(tokens_BL))
  ce = loss_lib.model_cross_entropy(
    module, noisy, tile(tokens_BL), chunk_size=chunk_size, valid_length_B=tile(lengths_B)
  )
  logp_BSL = -ce.reshape(batch, num_samples, width)
  scored_BSL = (masked_BSL & (completion_mask_BL[:, None, :] > 0)).astype(jnp.float32)
  per_sample = (logp_BSL * scored_BSL).sum(-1) / jnp.maximum(scored_BSL.sum(-1), 1.0)
  elbo_B = per_sample.mean(axis=1)
  t_hat_BS = scored_BSL.sum(-1) / jnp.maximum(completion_lengths_B[:, None], 1)
  weighted_BL = (
    jnp.exp(eubo_beta * logp_BSL) * scored_BSL / jnp.maximum(t_hat_BS, 1e-8)[..., None]
  ).mean(axis=1)
  seen_BL = weighted_BL > 0
  log_BL = jnp.log(jnp.where(seen_BL, weighted_BL, 1.0))
  eubo_B = (log_BL * seen_BL).sum(-1) / jnp.maximum(seen_BL.sum(-1), 1) / eubo_beta
  return elbo_B, eubo_B
