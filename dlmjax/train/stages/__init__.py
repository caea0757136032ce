"""The stages: each declares a `base.Stage` (loss, batch source, arrays, metrics, evaluator);
the step and the loop take it as it is and never ask which stage runs."""

from dlmjax.train import choices
from dlmjax.train.stages import base, preference, pretrain, reward, rl, sft

BUILDERS = {
  'pretrain': pretrain.stage,
  'sft': sft.stage,
  'rl': rl.stage,
  'preference': preference.stage,
  'reward': reward.stage,
}
TRAITS = choices.STAGES  # what the layers below read of each stage (train/choices.py)


def build(config) -> base.Stage:
  """The Stage of config.stage, built for this config."""
  return BUILDERS[config.stage](config)
