"""The stages: each declares a `base.Stage` (loss, batch source, arrays, metrics, evaluator);
the step and the loop take it as it is and never ask which stage runs."""

from dlmjax.train.stages import base, pretrain, rl, sft

BUILDERS = {'pretrain': pretrain.stage, 'sft': sft.stage, 'rl': rl.stage}


def build(config) -> base.Stage:
  """The Stage of config.stage, built for this config."""
  return BUILDERS[config.stage](config)
