"""What the layers below training may ask of a stage: its traits, which train/stages/ declares
for each stage and registers here, so that no code outside it tests a stage's name."""

from __future__ import annotations

import dataclasses

from dlmjax.config import registry
from dlmjax.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StageTraits:
  diffusion_loss: bool = True  # its loss is diffusion.objective's (block: layers on [x_t || x_0])
  chat_template: bool = True  # its rows, and so its checkpoints' prompts, use sft.chat_template
  score_head: bool = False  # its model ends in a scalar score head, not the output head (reward)


_STAGES: dict[str, StageTraits] = {}


def register(traits: dict[str, StageTraits]) -> None:
  """Registers the stages (the values of `stage`) with their traits."""
  registry.choices('stage', traits)
  _STAGES.update(traits)


def stage_traits(config) -> StageTraits:
  """The traits of config.stage (one line naming the choices for an unknown stage)."""
  registry.load()
  if config.stage not in _STAGES:
    raise ConfigError(
      f'stage={config.stage!r} is not one of {tuple(_STAGES)}; set --config.stage=<one of them>.'
    )
  return _STAGES[config.stage]


def attention_streams(config) -> int:
  """Sequence copies a training step's layers run on per real token: 2 for the block-diffusion
  objective ([x_t || x_0]) in a stage whose loss is it, else 1. FLOPs and MFU count real tokens
  with this factor."""
  block = config.diffusion.objective == 'block'
  return 2 if block and stage_traits(config).diffusion_loss else 1
