"""The RL objectives: one module each, registered here by name (rl.objective).

Each module declares one `base.Objective`: what the rollout records, the batch's arrays, the
advantages, the loss weights, its one estimator (for the loss and for the old / reference
scores), the loss, the config keys it reads, what it scores after the first EOS and its
description. Adding an objective is one new module and its line in REGISTRY.
"""

from __future__ import annotations

from dlmjax.rl.objectives import base, coupled_grpo, d1, espo, spg, trace, wd1, wd1pp

REGISTRY: dict[str, base.Objective] = {
  o.name: o
  for o in (
    d1.OBJECTIVE,
    espo.OBJECTIVE,
    spg.OBJECTIVE,
    wd1.OBJECTIVE,
    wd1pp.OBJECTIVE,
    coupled_grpo.OBJECTIVE,
    trace.OBJECTIVE,
  )
}


def names() -> tuple[str, ...]:
  """The rl.objective values, in registry order (the config's choices)."""
  return tuple(REGISTRY)


def get(name: str) -> base.Objective:
  """The objective called `name`; an unknown name fails in one line listing the known ones."""
  if name not in REGISTRY:
    raise ValueError(f'rl.objective={name!r} is not one of {names()}; set --config.rl.objective.')
  return REGISTRY[name]


def of(config) -> base.Objective:
  """The run's objective (config.rl.objective)."""
  return get(config.rl.objective)


def describe(config) -> str:
  """One line naming the objective's switches and values, printed when a run starts."""
  return f'rl.objective={config.rl.objective}: {of(config).describe(config)}'
