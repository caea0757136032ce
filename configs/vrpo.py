"""Preference alignment with VRPO (LLaDA 1.5, arXiv 2505.19223) from a fine-tuned model, on the
built-in preference pairs (a task's worked solution over another problem's).

    python -m dlmjax.train --config=configs/tiny.py        # pre-train: runs/tiny
    python -m dlmjax.train --config=configs/sft.py         # SFT on the task set: runs/sft
    python -m dlmjax.train --config=configs/vrpo.py        # VRPO from runs/sft: runs/vrpo
    python -m dlmjax.train --config=configs/vrpo.py --config.preference.antithetic=False \
      --config.preference.n_time=1  # no reductions
    python -m dlmjax.train --config=configs/vrpo.py:near_miss  # the harder built-in pairs

Each step scores every pair's chosen and rejected response under the frozen reference (the SFT
model) and the policy with preference.budget masked forwards each, and takes DPO's loss on the
ELBO differences. metrics.jsonl gets loss, margin and preference_accuracy per step; the held-out
pairs' val_margin / val_preference_accuracy every eval.every steps (docs/preference.md).
configs/vrpo.py:PRESET[,near_miss] sets a preset's model keys; near_miss trains on the built-in
near-miss pairs (each problem's own worked solution with a plausible wrong final answer).
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  c = config_lib.defaults()
  names = [a for a in (arg or '').split(',') if a]
  for preset in [n for n in names if n != 'near_miss']:  # a preset's model keys
    config_lib.apply_preset(c.model, preset)
  c.stage = 'preference'
  c.init_from = 'runs/sft'
  c.output_dir = 'runs/vrpo'
  c.sft.chat_template = 'plain'
  c.preference.beta = 0.1
  c.preference.budget = 4
  c.train.steps = 20
  c.train.global_batch_size = 16
  c.train.micro_batch_size = 8
  c.train.schedule = 'constant'
  c.train.lr = 1e-4
  c.train.warmup_steps = 0
  c.eval.every = 10
  c.eval.batches = 2
  c.checkpoint.every = 20
  c.log.every = 5
  if 'near_miss' in names:  # rejected: the problem's own solution with a wrong final answer
    c.preference.train_file = 'builtin:near_miss'
    c.output_dir += '_near_miss'
  return c
