"""RL from verifiable rewards (diffu-GRPO, d1) on a built-in task, from a fine-tuned model.

    python -m dlmjax.train --config=configs/tiny.py        # pre-train: runs/tiny
    python -m dlmjax.train --config=configs/sft.py --config.model.seq_len=80   # SFT: runs/sft
    python -m dlmjax.train --config=configs/rl.py --config.init_from=runs/sft
    python -m dlmjax.train --config=configs/rl.py:espo     # ESPO instead of d1
    python -m dlmjax.train --config=configs/rl.py:spg      # SPG (ELBO / EUBO mixture)
    python -m dlmjax.train --config=configs/rl.py:wd1      # wd1 (ratio-free weighted likelihood)
    python -m dlmjax.train --config=configs/rl.py:wd1pp    # wd1++ (every step's prediction)
    python -m dlmjax.train --config=configs/rl.py:coupled_grpo  # DiffuCoder's coupled-GRPO

Each rollout samples rl.group_size completions for global_batch_size / group_size prompts of
rl.task with the current params, scores them exactly, and takes rl.inner_updates optimizer steps
on them. metrics.jsonl gets loss, kl, clip_fraction, reward_mean/std and completion_length per
step and, per rollout, generate_s / score_s and the rollout's accuracy; step_time_s is the
update time. d1's switches (no std scaling, token normalisation, frozen-init KL reference) are
the defaults; all of them are rl.* keys.
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  c = config_lib.defaults()
  c.stage = 'rl'
  c.init_from = 'runs/sft'
  c.output_dir = 'runs/rl'
  c.sft.chat_template = 'plain'
  # The quick start's SFT model (configs/sft.py) learnt 4x4 sudoku on an 80-token canvas: RL goes
  # on with that task, its 48-token prompts and 32-token answers filling the canvas.
  c.rl.task = 'sudoku4'
  c.sampler.gen_length = 32
  c.rl.group_size = 4
  c.rl.inner_updates = 2
  c.train.steps = 40
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.schedule = 'constant'
  c.train.lr = 1e-4  # d1: 3e-6 constant for 8B LoRA; tiny full fine-tuning tolerates more
  c.train.warmup_steps = 0
  c.train.b2 = 0.99  # d1: AdamW(0.9, 0.99), weight decay 0.1, grad-norm clip 0.2
  c.train.clip_grad_norm = 0.2
  c.checkpoint.every = 20
  c.log.every = 2
  if arg == 'espo':
    c.rl.objective = 'espo'
    c.output_dir = 'runs/rl_espo'
  elif arg == 'spg':  # SPG-Mixture (block-wise masks, no ratio, no KL)
    c.rl.objective = 'spg'
    c.rl.kl_beta = 0.0
    c.output_dir = 'runs/rl_spg'
  elif arg == 'wd1':  # no ratio, no old or reference policy, no KL
    c.rl.objective = 'wd1'
    c.rl.kl_beta = 0.0
    c.output_dir = 'runs/rl_wd1'
  elif arg == 'wd1pp':  # wd1 on every decoding step's prediction; the uncached sampler
    c.rl.objective = 'wd1pp'
    c.rl.kl_beta = 0.0
    c.sampler.cache = 'none'
    c.output_dir = 'runs/rl_wd1pp'
  elif arg == 'coupled_grpo':  # DiffuCoder's recipe: beta 0.01, no prompt masking
    c.rl.objective = 'coupled_grpo'
    c.rl.kl_beta = 0.01
    c.rl.p_mask_prompt = 0.0
    c.output_dir = 'runs/rl_coupled_grpo'
  elif arg:
    raise ValueError(
      'configs/rl.py takes no argument, "espo", "spg", "wd1", "wd1pp" or "coupled_grpo", '
      f'got {arg!r}.'
    )
  return c
