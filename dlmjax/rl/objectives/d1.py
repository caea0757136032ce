"""diffu-GRPO (d1, arXiv 2504.12216; dllm-reasoning/d1 diffu_grpo_trainer.py): the one-step token
estimate, group-mean advantages, a clipped ratio and a k3 KL per token.

After the first EOS: d1 scores the completion as generated; its estimate masks every completion
position, so what the canvas holds there never reaches the model (either choice gives the same
loss) and the rollout keeps the EOS-padded rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from dlmjax.rl import estimators
from dlmjax.rl.objectives import base


def token_loss(logp_BL, old_logp_BL, ref_logp_BL, advantages_B, *, eps: float, beta: float):
  """diffu-GRPO per token: clipped ratio exp(logp - old) with the sequence advantage, plus
  beta * k3 KL to the reference. Returns (loss [B, L], kl [B, L], clipped [B, L])."""
  ratio_BL = jnp.exp(logp_BL - old_logp_BL)
  surrogate_BL, clipped_BL = base.clipped_surrogate(ratio_BL, advantages_B[:, None], eps)
  kl_BL = base.k3(logp_BL, ref_logp_BL)
  return surrogate_BL + beta * kl_BL, kl_BL, clipped_BL


def one_step_estimate(module, arrays, *, seed, settings):
  """d1's one-step token estimate of the batch (estimators.d1_token_logprobs)."""
  return estimators.d1_token_logprobs(
    module,
    arrays['tokens'],
    arrays['prompt_lengths'],
    arrays['lengths'],
    arrays['mask_seeds'],
    seed=seed,
    **settings,
  )


class D1(base.Objective):
  name = 'd1'
  config_keys = ('p_mask_prompt', 'clip_eps', 'kl_beta', 'ref_sync_every', 'ref_sync_alpha')

  def describe(self, config):
    r = config.rl
    return (
      f'one-step token estimate (p_mask_prompt={r.p_mask_prompt:g}), group-mean advantages, '
      f'clip_eps={r.clip_eps:g}, {base.kl_text(r)}'
    )

  def estimate(self, module, arrays, *, seed, settings):
    return one_step_estimate(module, arrays, seed=seed, settings=settings)

  def loss(self, estimate, arrays, rl):
    return token_loss(
      estimate, arrays['old'], arrays['ref'], arrays['advantages'], eps=rl.clip_eps, beta=rl.kl_beta
    )


OBJECTIVE = D1()
