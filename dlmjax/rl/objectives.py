"""Policy losses on per-token (d1, coupled-GRPO, TraceRL) or per-sequence (ESPO, SPG, wd1)
log-likelihood estimates.

Each returns per-unit losses and diagnostics; the stage weights them (token or sequence
normalisation) so that the shared step's micro-batch accumulation gives the global average.
"""

from __future__ import annotations

import jax.numpy as jnp

OBJECTIVES = ('d1', 'espo', 'spg', 'wd1', 'wd1pp', 'coupled_grpo', 'trace')
# Objectives without a ratio or a KL term: their rollouts score no old or reference estimates.
RATIO_FREE = ('spg', 'wd1', 'wd1pp')
# Objectives scoring per-token estimates ([B, L] old / reference arrays); the others per sequence.
TOKEN_OBJECTIVES = ('d1', 'coupled_grpo', 'trace')
# Objectives whose rollouts record each token's commit step (the batch's `steps`).
TRAJECTORY_OBJECTIVES = ('trace',)
# Objectives whose rollouts record each decoding step's predicted completion x_0|l (wd1++): the
# batch's `tokens` are a drawn step's state x_l and its `targets` that step's prediction.
STEPWISE_OBJECTIVES = ('wd1pp',)


def describe(config) -> str:
  """One line naming the objective's switches and values, printed when a run starts."""
  r = config.rl
  kl = f'kl_beta={r.kl_beta:g} (k3' if r.objective != 'espo' else f'kl_beta={r.kl_beta:g} (k2'
  sync = (
    f', reference refreshed every {r.ref_sync_every} steps with alpha={r.ref_sync_alpha:g})'
    if r.ref_sync_every
    else ', frozen init reference)'
  )
  kl = kl + sync if r.kl_beta > 0 else 'no KL term'
  text = {
    'd1': f'one-step token estimate (p_mask_prompt={r.p_mask_prompt:g}), group-mean advantages, '
    f'clip_eps={r.clip_eps:g}, {kl}',
    'espo': f'sequence ELBO ({r.elbo_samples} samples), group-mean advantages, '
    f'clip_eps={r.clip_eps:g}, {kl}',
    'spg': f'block-wise ELBO/EUBO ({r.elbo_samples} samples, eubo_beta={r.spg_eubo_beta:g}, '
    f'mix_weight={r.spg_mix_weight:g}), group-mean advantages, no ratio, no KL term',
    'wd1': f'one-step token estimate (p_mask_prompt={r.p_mask_prompt:g}) summed per completion, '
    'weights softmax(A) - softmax(-A) per group, no ratio, no KL term',
    'wd1pp': 'wd1++ (wd1 v2 Eq. 10): each decoding step l = 1..L predicts x_0|l from its state '
    f'x_l; rewards of all G x L predictions ({config.sampler.steps} steps), weights '
    f'softmax(psi A) - softmax(-psi A) over them (psi={r.wd1pp_psi:g}); per row and update one '
    'l ~ U{1..L}, log pi(x_0|l | x_l) over the masked tokens of x_l from one forward; factor '
    + (
      'L / G x 1 / t_l (our reading of the garbled "L / G l": t_l = masked share of the canvas '
      'in x_l, the DCE weight)'
      if r.wd1pp_dce_weight
      else 'L / G (rl.wd1pp_dce_weight=False: no 1 / t_l)'
    )
    + ', no ratio, no KL term',
    'coupled_grpo': 'coupled complementary-mask estimate (t ~ U[0.2, 0.8], '
    f'p_mask_prompt={r.p_mask_prompt:g}), leave-one-out advantages, clip_eps={r.clip_eps:g}, {kl}',
    'trace': "TraceRL's trajectory estimate (each token under the state the sampler committed it "
    f'in, per block), group-mean advantages, clip_eps={r.clip_eps:g}, {kl}',
  }[r.objective]
  return f'rl.objective={r.objective}: {text}'


def clipped_surrogate(ratio, advantage, eps: float):
  """-min(rho A, clip(rho, 1-eps, 1+eps) A) and whether the clip is active: the clipped term is
  the smaller, so the unit gets no policy gradient (rho > 1+eps with A > 0, or rho < 1-eps with
  A < 0; PPO's clip fraction). TRL's and d1's `clip_ratio` (rho A < clip(rho) A) counts the
  opposite side, where rho left the range but the unclipped term is kept."""
  unclipped = ratio * advantage
  clipped = jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * advantage
  is_clipped = ((ratio < 1.0 - eps) & (advantage < 0)) | ((ratio > 1.0 + eps) & (advantage > 0))
  return -jnp.minimum(unclipped, clipped), is_clipped


def k3(logp, ref_logp):
  """Schulman's k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


def k2(elbo, ref_elbo):
  """ESPO's k2 KL of the sequence: (ELBO - ELBO_ref)^2 / 2."""
  return 0.5 * jnp.square(elbo - ref_elbo)


def d1_token_loss(logp_BL, old_logp_BL, ref_logp_BL, advantages_B, *, eps: float, beta: float):
  """diffu-GRPO per token: clipped ratio exp(logp - old) with the sequence advantage, plus
  beta * k3 KL to the reference. Returns (loss [B, L], kl [B, L], clipped [B, L])."""
  ratio_BL = jnp.exp(logp_BL - old_logp_BL)
  surrogate_BL, clipped_BL = clipped_surrogate(ratio_BL, advantages_B[:, None], eps)
  kl_BL = k3(logp_BL, ref_logp_BL)
  return surrogate_BL + beta * kl_BL, kl_BL, clipped_BL


def espo_sequence_loss(
  elbo_B, old_elbo_B, ref_elbo_B, advantages_B, length_B, *, eps: float, beta: float
):
  """ESPO per sequence: ratio exp((ELBO - ELBO_old) / L), clipped, plus beta * k2 KL.
  Returns (loss [B], kl [B], clipped [B])."""
  ratio_B = jnp.exp((elbo_B - old_elbo_B) / length_B)
  surrogate_B, clipped_B = clipped_surrogate(ratio_B, advantages_B, eps)
  kl_B = k2(elbo_B, ref_elbo_B)
  return surrogate_B + beta * kl_B, kl_B, clipped_B


def spg_sequence_loss(elbo_B, eubo_B, advantages_B, *, mix_weight: float):
  """SPG (sandwiched policy gradient): -A * log-likelihood bound per sequence, no ratio, no KL.

  Rows with A > 0 push up the ELBO (a lower bound); the others push down the mixture
  mix_weight * EUBO + (1 - mix_weight) * ELBO (SPG's upper-bound side). Returns loss [B]."""
  negative_B = mix_weight * eubo_B + (1.0 - mix_weight) * elbo_B
  return -advantages_B * jnp.where(advantages_B > 0, elbo_B, negative_B)


def wd1_sequence_loss(logp_B, weights_B):
  """wd1 (Tang et al., arXiv 2507.08838; xiaohangt/wd1 rev_grpo_trainer.py compute_loss): the
  ratio-free weighted log-likelihood  -sum_i w+_i log pi(o_i) + sum_i w-_i log pi(o_i)  over a
  group, w+ = softmax(A), w- = softmax(-A) (advantages.wd1_weights gives w+ - w-), log pi(o_i) the
  sum of the one-step token estimates over the completion. No old or reference policy, no clip.
  Per row: -(w+_i - w-_i) log pi(o_i); the stage sums a group's rows and averages the groups.
  Returns loss [B]."""
  return -weights_B * logp_B
