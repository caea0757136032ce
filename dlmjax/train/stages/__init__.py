"""The stages: each declares a `base.Stage` (loss, batch source, arrays, metrics, evaluator);
the step and the loop take it as it is and never ask which stage runs."""

from dlmjax.config.stages import StageTraits
from dlmjax.train.stages import base, preference, pretrain, reward, rl, sft

BUILDERS = {
  'pretrain': pretrain.stage,
  'sft': sft.stage,
  'rl': rl.stage,
  'preference': preference.stage,
  'reward': reward.stage,
}
# What the layers below read of a stage (train/config_checks registers these): pre-training
# renders no chat template; RL's loss is its objective's, and preference's VRPO's DPO over
# ELBO estimates, not diffusion.objective's; reward's model ends in a score head, its loss the
# Bradley-Terry loss on clean rows.
TRAITS = {
  'pretrain': StageTraits(chat_template=False),
  'sft': StageTraits(),
  'rl': StageTraits(diffusion_loss=False),
  'preference': StageTraits(diffusion_loss=False),
  'reward': StageTraits(diffusion_loss=False, score_head=True),
}


def build(config) -> base.Stage:
  """The Stage of config.stage, built for this config."""
  return BUILDERS[config.stage](config)
