"""The distillation objectives of the SFT stage (sft.objective): one module each, registered here.

Each module declares one `base.Objective`: how the active block is masked, the arrays the teacher
rows carry for it, and how the two passes' CE and certainty terms combine. Adding an objective is
one new module and its line in REGISTRY.
"""

from __future__ import annotations

from dlmjax.diffusion.distill import base, certainty, trajectory

REGISTRY: dict[str, base.Objective] = {
  o.name: o for o in (certainty.OBJECTIVE, trajectory.OBJECTIVE)
}


PLAIN = 'llada'  # sft.objective's non-distilling value: LLaDA's SFT loss on sft.train_file
# The values of sft.objective: the plain SFT loss, then every distillation objective.
OBJECTIVES = (PLAIN, *REGISTRY)


def distills(objective: str) -> bool:
  """Whether sft.objective trains on the teacher's rows."""
  return objective != PLAIN


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def get(name: str) -> base.Objective:
  """The objective called `name`; an unknown one fails in one line naming the known ones."""
  if name not in REGISTRY:
    raise ValueError(
      f'sft.objective={name!r} is not a distillation objective; known: {names()} (or '
      f'{PLAIN}, the plain SFT loss); set --config.sft.objective.'
    )
  return REGISTRY[name]
