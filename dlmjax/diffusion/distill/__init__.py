"""The distillation objectives of the SFT stage (sft.objective): one module each, registered here.

Each module declares one `base.Objective`: how the active block is masked, the arrays the teacher
rows carry for it, and how the two passes' CE and certainty terms combine. Adding an objective is
one new module and its line in REGISTRY, which names it by reference (imported when a run uses
it: the names are checked before jax loads).
"""

from __future__ import annotations

import functools

from dlmjax.config import lazy

REGISTRY: dict[str, str] = {
  'certainty': 'dlmjax.diffusion.distill.certainty:OBJECTIVE',
  'trajectory': 'dlmjax.diffusion.distill.trajectory:OBJECTIVE',
}


PLAIN = 'llada'  # sft.objective's non-distilling value: LLaDA's SFT loss on sft.train_file
# The values of sft.objective: the plain SFT loss, then every distillation objective.
OBJECTIVES = (PLAIN, *REGISTRY)


def distills(objective: str) -> bool:
  """Whether sft.objective trains on the teacher's rows."""
  return objective != PLAIN


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


@functools.cache
def get(name: str):
  """The objective (a base.Objective) called `name`; an unknown one fails in one line naming the
  known ones."""
  if name not in REGISTRY:
    raise ValueError(
      f'sft.objective={name!r} is not a distillation objective; known: {names()} (or '
      f'{PLAIN}, the plain SFT loss); set --config.sft.objective.'
    )
  return lazy.load(REGISTRY[name])
