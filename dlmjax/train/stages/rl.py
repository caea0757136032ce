"""RL from verifiable rewards: rollouts of the current policy, diffu-GRPO (d1), ESPO or SPG loss.

The batch source (dlmjax/rl/rollout.py) generates G completions per prompt with the current
params, scores them, and serves the same rollouts rl.inner_updates times, each with its own mask
seed and the old / reference estimates for it, computed once after generation.
"""

from __future__ import annotations

import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.rl import estimators, objectives
from dlmjax.rl import rollout as rollout_lib


def loss_fn(config):
  """loss(module, tokens=, prompt_lengths=, lengths=, ...) -> (objective, sums)."""
  r, num_micro = config.rl, config_lib.num_microbatches(config)
  common = dict(seed=config.seed, mask_id=config.model.mask_token_id,
                chunk_size=config.model.loss_chunk_tokens)
  beta = r.kl_beta

  def fn(module, *, tokens, prompt_lengths, lengths, mask_seeds, advantages, old, ref, weight,
         completion_mask, rewards, step=None, micro_index=None, example_ids_B=None):
    del step, micro_index, example_ids_B  # randomness comes from the rollout's mask seeds
    if r.objective == 'd1':
      logp = estimators.d1_token_logprobs(module, tokens, prompt_lengths, lengths, mask_seeds,
                                          p_mask_prompt=r.p_mask_prompt, **common)
      loss, kl, clipped = objectives.d1_token_loss(logp, old, ref, advantages, eps=r.clip_eps,
                                                   beta=beta)
    elif r.objective == 'spg':
      elbo, eubo = estimators.spg_sequence_bounds(
          module, tokens, prompt_lengths, lengths, completion_mask, mask_seeds,
          num_samples=r.elbo_samples, block_length=config.sampler.block_length,
          p_mask_prompt=r.p_mask_prompt, eubo_beta=r.spg_eubo_beta, **common)
      loss = objectives.spg_sequence_loss(elbo, eubo, advantages, mix_weight=r.spg_mix_weight)
      kl = clipped = jnp.zeros_like(loss)  # SPG has neither a ratio nor a KL term
    else:
      elbo = estimators.sequence_elbo(module, tokens, prompt_lengths, lengths, mask_seeds,
                                      num_samples=r.elbo_samples, **common)
      loss, kl, clipped = objectives.espo_sequence_loss(
          elbo, old, ref, advantages, (lengths - prompt_lengths).astype(jnp.float32),
          eps=r.clip_eps, beta=beta)
    # `weight` holds each unit's share of the GLOBAL batch average (rollout.loss_weights), so
    # the step's mean over micro-batches of num_micro x partial sum is exactly that average.
    partial = jnp.sum(weight * loss)
    sums = dict(loss_sum=partial, kl_sum=jnp.sum(weight * kl),
                clip_sum=jnp.sum(weight * clipped.astype(jnp.float32)),
                tokens=jnp.sum(completion_mask), rows=jnp.float32(tokens.shape[0]),
                reward_sum=jnp.sum(rewards), reward_sq_sum=jnp.sum(jnp.square(rewards)))
    return num_micro * partial, sums

  return fn


def batch_iterator(config, *, process_index: int, process_count: int):
  return rollout_lib.RolloutSource(config, process_index=process_index,
                                   process_count=process_count)


def batch_keys(config) -> tuple[str, ...]:
  del config
  return rollout_lib.BATCH_KEYS


def metrics(sums) -> dict:
  rows = jnp.maximum(sums['rows'], 1.0)
  reward_mean = sums['reward_sum'] / rows
  return dict(loss=sums['loss_sum'], kl=sums['kl_sum'], clip_fraction=sums['clip_sum'],
              tokens=sums['tokens'], completion_length=sums['tokens'] / rows,
              reward_mean=reward_mean,
              reward_std=jnp.sqrt(jnp.maximum(sums['reward_sq_sum'] / rows - reward_mean**2, 0.0)))
