"""wd1 (Tang et al., arXiv 2507.08838; xiaohangt/wd1 rev_grpo_trainer.py compute_loss): the
ratio-free weighted log-likelihood of each completion, weights softmax(A) - softmax(-A) per group.

After the first EOS: as d1 (its estimate masks every completion position: nothing there is
seen), the rows stay EOS-padded.
"""

from __future__ import annotations

import jax.numpy as jnp

from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl.objectives import base, d1


def sequence_loss(logp_B, weights_B):
  """wd1's  -sum_i w+_i log pi(o_i) + sum_i w-_i log pi(o_i)  over a group, w+ = softmax(A),
  w- = softmax(-A) (advantages.wd1_weights gives w+ - w-), log pi(o_i) the sum of the one-step
  token estimates over the completion. No old or reference policy, no clip. Per row:
  -(w+_i - w-_i) log pi(o_i); the loss weights sum a group's rows and average the groups.
  Returns loss [B]."""
  return -weights_B * logp_B


class WD1(base.Objective):
  name = 'wd1'
  config_keys = ('p_mask_prompt',)
  scores = None
  kl = False

  def describe(self, config):
    return (
      f'one-step token estimate (p_mask_prompt={config.rl.p_mask_prompt:g}) summed per '
      'completion, weights softmax(A) - softmax(-A) per group, no ratio, no KL term'
    )

  def estimate(self, module, arrays, *, seed, settings):
    return d1.one_step_estimate(module, arrays, seed=seed, settings=settings)

  def loss(self, estimate, arrays, rl):
    del rl  # advantages holds wd1's weights (advantages below)
    return base.no_kl(
      sequence_loss(jnp.sum(estimate * arrays['completion_mask'], axis=1), arrays['advantages'])
    )

  def advantages(self, rewards, group_size, rl=None):
    """The signed weights softmax(A) - softmax(-A) of each group's mean-baseline advantages."""
    del rl
    return advantages_lib.wd1_weights(
      advantages_lib.group_advantages(rewards, group_size), group_size
    )

  def loss_weights(self, completion_mask_BL, *, normalisation='token', group_size=0):
    del normalisation
    return base.group_sum_weights(completion_mask_BL, group_size)


OBJECTIVE = WD1()
