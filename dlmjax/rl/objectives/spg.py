"""SPG, the sandwiched policy gradient (arXiv 2510.09541; facebookresearch/SPG spg_trainer.py):
-A x the ELBO for rows with A > 0, -A x a mix of the EUBO and the ELBO for the others, from
block-wise masks; no ratio, no KL term, length-weighted.

After the first EOS: SPG's block-wise masks always mask the canvas after the completion, so what
it holds there is never seen; the rows stay EOS-padded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlmjax.config import ConfigError
from dlmjax.rl import estimators
from dlmjax.rl.objectives import base


def sequence_loss(elbo_B, eubo_B, advantages_B, *, mix_weight: float):
  """SPG: -A * log-likelihood bound per sequence, no ratio, no KL.

  Rows with A > 0 push up the ELBO (a lower bound); the others push down the mixture
  mix_weight * EUBO + (1 - mix_weight) * ELBO (SPG's upper-bound side). Returns loss [B]."""
  negative_B = mix_weight * eubo_B + (1.0 - mix_weight) * elbo_B
  return -advantages_B * jnp.where(advantages_B > 0, elbo_B, negative_B)


class SPG(base.Objective):
  name = 'spg'
  config_keys = ('elbo_samples', 'p_mask_prompt', 'spg_eubo_beta', 'spg_mix_weight')
  scores = None
  kl = False

  def check(self, config):
    r = config.rl
    if not 0 <= r.spg_mix_weight <= 1 or r.spg_eubo_beta < 1:
      raise ConfigError(
        f'rl.spg_mix_weight={r.spg_mix_weight} must be in [0, 1] and '
        f'rl.spg_eubo_beta={r.spg_eubo_beta} >= 1 (the EUBO is a bound for '
        'beta >= 1).'
      )

  def describe(self, config):
    r = config.rl
    return (
      f'block-wise ELBO/EUBO ({r.elbo_samples} samples, eubo_beta={r.spg_eubo_beta:g}, '
      f'mix_weight={r.spg_mix_weight:g}), group-mean advantages, no ratio, no KL term'
    )

  def settings(self, config):
    r = config.rl
    return dict(
      mask_id=config.model.mask_token_id,
      chunk_size=config.model.loss_chunk_tokens,
      num_samples=r.elbo_samples,
      block_length=config.sampler.block_length,
      p_mask_prompt=r.p_mask_prompt,
      eubo_beta=r.spg_eubo_beta,
    )

  def estimate(self, module, arrays, *, seed, settings):
    """(ELBO [B], EUBO [B]) from block-wise masks (estimators.spg_sequence_bounds)."""
    return estimators.spg_sequence_bounds(
      module,
      arrays['tokens'],
      arrays['prompt_lengths'],
      arrays['lengths'],
      arrays['completion_mask'],
      arrays['mask_seeds'],
      seed=seed,
      **settings,
    )

  def loss(self, estimate, arrays, rl):
    elbo, eubo = estimate
    return base.no_kl(sequence_loss(elbo, eubo, arrays['advantages'], mix_weight=rl.spg_mix_weight))

  def loss_weights(self, completion_mask_BL, *, normalisation='token', group_size=0):
    """The row's completion length / all rows' (SPG's length-weighted sequence average)."""
    del normalisation, group_size
    lengths = completion_mask_BL.sum(axis=1)
    return (lengths / max(lengths.sum(), 1.0)).astype(np.float32)


OBJECTIVE = SPG()
