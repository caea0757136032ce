"""A reward model (a score head on the model, Bradley-Terry loss) trained from a fine-tuned model
on the built-in preference pairs, for RL against a learned reward (docs/preference.md).

    python -m dlmjax.train --config=configs/tiny.py        # pre-train: runs/tiny
    python -m dlmjax.train --config=configs/sft.py         # SFT on the task set: runs/sft
    python -m dlmjax.train --config=configs/reward.py      # reward model from runs/sft: runs/reward
    python -m dlmjax.train --config=configs/reward.py:lora # LoRA, the head trained whole
    python -m dlmjax.train --config=configs/rl.py --config.rl.reward_model=runs/reward

Each step scores every pair's chosen and rejected row (prompt + response + EOS, clean) and takes
-log sigmoid(r(chosen) - r(rejected)); metrics.jsonl gets loss, margin and reward_accuracy, and
every eval.every steps the held-out pairs' val_reward_accuracy and val_margin.
configs/reward.py:PRESET[,lora][,near_miss] sets a preset's model keys (the GPU runs of
docs/preference.md); near_miss trains on the built-in near-miss pairs (docs/preference.md).
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  c = config_lib.defaults()
  names = [a for a in (arg or '').split(',') if a]
  for preset in [n for n in names if n not in ('lora', 'near_miss')]:
    config_lib.apply_preset(c.model, preset)
  c.stage = 'reward'
  c.init_from = 'runs/sft'
  c.output_dir = 'runs/reward'
  c.sft.chat_template = 'plain'
  c.train.steps = 30
  c.train.global_batch_size = 16
  c.train.micro_batch_size = 8
  c.train.schedule = 'constant'
  c.train.lr = 1e-4
  c.train.warmup_steps = 0
  c.eval.every = 10
  c.eval.batches = 4
  c.checkpoint.every = 30
  c.log.every = 5
  if 'lora' in names:  # adapters over the frozen SFT model; the new score head trains whole
    c.output_dir = 'runs/reward_lora'
    c.train.lora.rank = 16
    c.train.lora.alpha = 32.0
    c.train.lora.base_dtype = 'float32'
    c.train.lr = 1e-3
  if 'near_miss' in names:  # rejected: the problem's own solution with a wrong final answer
    c.preference.train_file = 'builtin:near_miss'
    c.output_dir += '_near_miss'
  return c
