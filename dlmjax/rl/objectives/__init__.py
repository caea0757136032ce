"""The RL objectives: one module each, registered here by name (rl.objective).

Each module declares one `base.Objective`: what the rollout records, the batch's arrays, the
advantages, the loss weights, its one estimator (for the loss and for the old / reference
scores), the loss, the config keys it reads, what it scores after the first EOS and its
description. Adding an objective is one new module and its line in REGISTRY, which names it by
reference (imported when a run uses it: the names are checked before jax loads).
"""

from __future__ import annotations

import functools

from dlmjax.config import lazy

REGISTRY: dict[str, str] = {
  name: f'dlmjax.rl.objectives.{name}:OBJECTIVE'
  for name in ('d1', 'espo', 'spg', 'wd1', 'wd1pp', 'coupled_grpo', 'trace')
}


def names() -> tuple[str, ...]:
  """The rl.objective values, in registry order (the config's choices)."""
  return tuple(REGISTRY)


@functools.cache
def get(name: str):
  """The objective (a base.Objective) called `name`; an unknown name fails in one line listing
  the known ones."""
  if name not in REGISTRY:
    raise ValueError(f'rl.objective={name!r} is not one of {names()}; set --config.rl.objective.')
  return lazy.load(REGISTRY[name])


def of(config):
  """The run's objective (config.rl.objective)."""
  return get(config.rl.objective)


def describe(config) -> str:
  """One line naming the objective's switches and values, printed when a run starts."""
  return f'rl.objective={config.rl.objective}: {of(config).describe(config)}'
