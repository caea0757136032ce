"""The values the stage, train.* and sft.* keys choose among, apart from the modules that
dispatch on them (stages/, optimizer, sft_rows): jax-free, so a config is checked before jax
loads. stages.BUILDERS (a function table) is tied to STAGES by tests/config_test.py."""

from dlmjax.config import StageTraits

# The stages and what the layers below read of each (train/config_checks registers these):
# pre-training renders no chat template; RL's loss is its objective's, and preference's VRPO's
# DPO over ELBO estimates, not diffusion.objective's; reward's model ends in a score head, its
# loss the Bradley-Terry loss on clean rows.
STAGES = {
  'pretrain': StageTraits(chat_template=False),
  'sft': StageTraits(),
  'rl': StageTraits(diffusion_loss=False),
  'preference': StageTraits(diffusion_loss=False),
  'reward': StageTraits(diffusion_loss=False, score_head=True),
}
# train.schedule's warmup-stable-decay shapes: the anneal of each (MegaDLMs' --lr-wsd-decay-style).
WSD_STYLES = {'wsd': 'exponential', 'wsd_linear': 'linear', 'wsd_cosine': 'cosine'}
SCHEDULES = (*WSD_STYLES, 'cosine', 'constant')  # train.schedule
TOO_LONG = ('truncate', 'drop', 'error')  # sft.too_long: rows longer than the canvas
