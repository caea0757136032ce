"""Log-likelihood estimates of a completion under a masked DLM, for the policy ratio and KL.

Rows are right-padded: prompt [0, prompt_len), the completion canvas [prompt_len, length), pads
after (no valid token attends to them). Every mask derives from (seed, mask_seed) per row, so
the policy, the old policy and the reference see the same masks within one inner iteration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import likelihood
from dlmjax.diffusion import loss as loss_lib

_RL_STREAM = 7  # keeps RL masks apart from the pre-training mask streams (masking.py)


def row_keys(seed: int, mask_seeds_B):
  base = jax.random.fold_in(jax.random.key(seed), _RL_STREAM)
  return jax.vmap(lambda s: jax.random.fold_in(base, s))(mask_seeds_B)


def d1_token_logprobs(module, tokens_BL, prompt_lengths_B, lengths_B, mask_seeds_B, *, seed: int,
                      mask_id: int, p_mask_prompt: float, chunk_size: int = 0):
  """d1's one-step estimate: log p(o_k | prompt with each token masked w.p. p_mask_prompt, all
  completion tokens masked) for every completion position k; [B, L], 0 outside the completion."""
  positions_L = jnp.arange(tokens_BL.shape[1])
  prompt_BL = positions_L < prompt_lengths_B[:, None]
  completion_BL = ~prompt_BL & (positions_L < lengths_B[:, None])
  uniform_BL = jax.vmap(lambda k: jax.random.uniform(k, tokens_BL.shape[1:]))(
      row_keys(seed, mask_seeds_B))
  masked_BL = completion_BL | (prompt_BL & (uniform_BL < p_mask_prompt))
  noisy_BL = jnp.where(masked_BL, mask_id, tokens_BL)
  ce_BL = loss_lib.model_cross_entropy(module, noisy_BL, tokens_BL, chunk_size=chunk_size,
                                       valid_length_B=lengths_B)
  return jnp.where(completion_BL, -ce_BL, 0.0)


def sequence_elbo(module, tokens_BL, prompt_lengths_B, lengths_B, mask_seeds_B, *, seed: int,
                  mask_id: int, num_samples: int, chunk_size: int = 0):
  """ESPO's sequence log-likelihood: LLaDA's low-variance ELBO of the completion given the
  prompt (dlmjax.diffusion.likelihood) with num_samples stratified mask counts; [B]."""
  settings = likelihood.LikelihoodConfig(mc_num=num_samples, mc_batch=num_samples,
                                         chunk_tokens=chunk_size)
  return likelihood.log_likelihood(module, tokens_BL, prompt_lengths_B, lengths_B,
                                   row_keys(seed, mask_seeds_B), settings, mask_id=mask_id)
