"""The distillation keys of the SFT stage (sft.objective, sft.teacher_file,
sft.certainty_weight), checked beside the objectives that read them (registered with
dlmjax.config's validation registry). That the teacher file exists is the stage's start-up check
(train/stages/sft.py), like sft.train_file's."""

from __future__ import annotations

from dlmjax.config import ConfigError, registry
from dlmjax.diffusion import distill

registry.choices('sft.objective', distill.OBJECTIVES)


@registry.check(stage='sft')
def distillation(config):
  s = config.sft
  if not distill.distills(s.objective):
    return
  if not s.teacher_file:
    raise ConfigError(
      f"sft.objective={s.objective} trains on the teacher's rows: write them with `python -m "
      'dlmjax.distill --init-from RUN --output FILE.npz` and set --config.sft.teacher_file.'
    )
  if config.data.packing:
    raise ConfigError(
      f'sft.objective={s.objective} reads one teacher row per conversation: set '
      '--config.data.packing=False.'
    )
  if not s.certainty_weight >= 0:
    raise ConfigError(
      f'sft.certainty_weight={s.certainty_weight} must be >= 0 (LLaDA: 2, Dream: 1, 0 = CE only).'
    )
