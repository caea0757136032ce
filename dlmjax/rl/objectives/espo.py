"""ESPO (arXiv 2512.03759): LLaDA's sequence ELBO in a sequence-level clipped ratio
exp((ELBO - ELBO_old) / L), and a k2 KL.

After the first EOS: the rows stay EOS-padded (the ELBO's unmasked context holds EOS there).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlmjax.rl import estimators
from dlmjax.rl.objectives import base


def sequence_loss(
  elbo_B, old_elbo_B, ref_elbo_B, advantages_B, length_B, *, eps: float, beta: float
):
  """ESPO per sequence: ratio exp((ELBO - ELBO_old) / L), clipped, plus beta * k2 KL.
  Returns (loss [B], kl [B], clipped [B])."""
  ratio_B = jnp.exp((elbo_B - old_elbo_B) / length_B)
  surrogate_B, clipped_B = base.clipped_surrogate(ratio_B, advantages_B, eps)
  kl_B = base.k2(elbo_B, ref_elbo_B)
  return surrogate_B + beta * kl_B, kl_B, clipped_B


class ESPO(base.Objective):
  name = 'espo'
  config_keys = ('elbo_samples', 'clip_eps', 'kl_beta', 'ref_sync_every', 'ref_sync_alpha')
  scores = 'sequence'

  def describe(self, config):
    r = config.rl
    return (
      f'sequence ELBO ({r.elbo_samples} samples), group-mean advantages, '
      f'clip_eps={r.clip_eps:g}, {base.kl_text(r, "k2")}'
    )

  def settings(self, config):
    return dict(
      mask_id=config.model.mask_token_id,
      chunk_size=config.model.loss_chunk_tokens,
      num_samples=config.rl.elbo_samples,
    )

  def estimate(self, module, arrays, *, seed, settings):
    return estimators.sequence_elbo(
      module,
      arrays['tokens'],
      arrays['prompt_lengths'],
      arrays['lengths'],
      arrays['mask_seeds'],
      seed=seed,
      **settings,
    )

  def loss(self, estimate, arrays, rl):
    return sequence_loss(
      estimate,
      arrays['old'],
      arrays['ref'],
      arrays['advantages'],
      (arrays['lengths'] - arrays['prompt_lengths']).astype(jnp.float32),
      eps=rl.clip_eps,
      beta=rl.kl_beta,
    )

  def loss_weights(self, completion_mask_BL, *, normalisation='token', group_size=0):
    """1 / rows per sequence."""
    del normalisation, group_size
    rows = completion_mask_BL.shape[0]
    return np.full((rows,), 1.0 / rows, np.float32)


OBJECTIVE = ESPO()
