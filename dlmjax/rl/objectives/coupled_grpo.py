"""Coupled-GRPO (DiffuCoder, arXiv 2506.20639; apple/ml-diffucoder src/open_r1/coupled_grpo.py):
d1's clipped ratio and k3 KL on the coupled (complementary-mask) token estimate, with
leave-one-out advantages.

After the first EOS: DiffuCoder scores the completion as generated. Its three views mask the
whole completion canvas (view 0) or complementary parts of it (views 1 and 2), so the tokens the
sampler left after the first EOS are the unmasked context of the partial views; the loss counts
the tokens up to and including the first EOS. The rollout keeps those tokens as generated.
"""

from __future__ import annotations

from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import estimators
from dlmjax.rl.objectives import base, d1


class CoupledGRPO(base.Objective):
  name = 'coupled_grpo'
  config_keys = d1.D1.config_keys
  after_eos = 'generated'

  def describe(self, config):
    r = config.rl
    return (
      'coupled complementary-mask estimate (t ~ U[0.2, 0.8], '
      f'p_mask_prompt={r.p_mask_prompt:g}), leave-one-out advantages, clip_eps={r.clip_eps:g}, '
      f'{base.kl_text(r)}'
    )

  def estimate(self, module, arrays, *, seed, settings):
    return estimators.coupled_token_logprobs(
      module,
      arrays['tokens'],
      arrays['prompt_lengths'],
      arrays['lengths'],
      arrays['mask_seeds'],
      seed=seed,
      **settings,
    )

  def loss(self, estimate, arrays, rl):
    return d1.OBJECTIVE.loss(estimate, arrays, rl)

  def advantages(self, rewards, group_size, rl=None):
    """DiffuCoder's baseline: r_i minus the mean of the group's other rewards."""
    del rl
    return advantages_lib.group_advantages(rewards, group_size, baseline='leave_one_out')


OBJECTIVE = CoupledGRPO()
