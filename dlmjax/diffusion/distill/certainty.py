"""dParallel's certainty-forcing distillation (Chen et al., arXiv 2509.26488; czg1225/dParallel
LLaDA/llada_train.py): in the active block every token is masked with p = (1 - eps) t + eps,
t = 0.5 fixed, and the loss is L = CE + CE_rev + beta (L_cert + L_cert_rev), beta = 2 for LLaDA
(1 for Dream), the certainty temperature T = 0.5."""

from __future__ import annotations

import jax

from dlmjax.diffusion.distill import base

MASK_T = 0.5  # dParallel's fixed t (its t ~ U line is commented out)


class Certainty(base.Objective):
  name = 'certainty'

  def block_mask(self, key, active_L, arrays_L, settings):
    p = (1.0 - base.TIME_EPS) * MASK_T + base.TIME_EPS
    return jax.random.uniform(key, active_L.shape) < p

  def combine(self, terms, settings):
    beta = settings['certainty_weight']
    return terms['ce'] + terms['ce_rev'] + beta * (terms['cert'] + terms['cert_rev'])

  def describe(self, settings):
    return (
      f'dParallel certainty forcing: block {settings["block_size"]}, p = 0.5, CE + CE_rev + '
      f'{settings["certainty_weight"]:g} (H + H_rev) at T = {settings["temperature"]:g}'
    )


OBJECTIVE = Certainty()
