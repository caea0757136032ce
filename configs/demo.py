"""The three-stage demo's recipe: overrides of configs/{tiny,sft,rl,vrpo,reward}.py, minutes per
seed on a CPU.

    python -m dlmjax.demo --seeds 0,1,2 --task arithmetic       # the three stages, per seed
    python -m dlmjax.demo --route vrpo    # SFT -> VRPO;  --route reward: SFT -> reward model -> RL
    python -m dlmjax.train --config=configs/demo.py:rl,arithmetic,spg \
        --config.init_from=runs/demo/seed0/sft --config.output_dir=runs/rl_spg

`python -m dlmjax.demo` chains the stages (each from the previous one's checkpoint); get_config
gives one stage alone, as "STAGE[,TASK[,OBJECTIVE]]" (an SFT stage alone reads the built-in rows
of its task unless --config.sft.train_file is given). The result and how each value was chosen:
docs/benchmarks.md, "Three-stage result" (the trials: docs/history/rl.md).
"""

import copy
import os

STAGES = ('pretrain', 'sft', 'rl')  # the default route (dlmjax/demo/routes.py ROUTES: vrpo, reward)
BASE_CONFIGS = {
  'pretrain': 'tiny.py',
  'sft': 'sft.py',
  'rl': 'rl.py',
  'vrpo': 'vrpo.py',
  'reward': 'reward.py',
}

# Per task: (prompt width, generated tokens) of the rollouts and the held-out decoding; their sum
# is the canvas, every stage's model.seq_len (RoPE has no length-bound weights). From each task's
# longest plain-template prompt and answer (+ EOS) on the built-in tokenizer; a sudoku4 prompt is
# 44 tokens, its answer 27 + EOS. Two tokens per diffusion step (half the rollout time of one),
# one block.
TASK_CANVAS = {
  'sudoku4': (48, 32),
  'arithmetic': (22, 58),
  'countdown3': (36, 44),
  'countdown4': (40, 56),
}

RL_STEPS = 60  # 15 rollouts: about 4 minutes of a seed's 9
SELECT_EVERY = 10  # RL steps between the validation scores that pick the RL stage's checkpoint

STAGE_RECIPE = {
  'pretrain': {
    'train.steps': 40,  # the code corpus barely helps the tasks: a short stage, as a start
    'train.wsd_decay_steps': 8,
    'checkpoint.every': 0,  # the final step only
    # The tiny preset's 5.5M shape, on which the demo's results were measured (configs/tiny.py
    # narrows it to d_model 128 for its 5-minute run).
    'model.d_model': 256,
    'model.num_heads': 4,
    'model.num_kv_heads': 4,
    'model.ffn_dim': 768,
  },
  'sft': {
    'train.steps': 240,  # copy the givens, then fill; the reward is seed-dependent here
    'train.lr': 2e-3,
    'train.min_lr': 2e-4,
    'train.warmup_steps': 10,
    'train.wsd_decay_steps': 24,  # LLaDA: decay over the final 10%
    'checkpoint.every': 0,
  },
  'rl': {
    'rl.group_size': 4,  # 8 prompts x 4 per rollout: more prompts seen than 4 x 8
    'rl.inner_updates': 4,  # updates are cheap next to generation (d1: 8 on sudoku)
    'train.global_batch_size': 32,
    'train.micro_batch_size': 16,
    'train.lr': 3e-4,  # lower barely moves the reward; higher collapses the policy
    'train.warmup_steps': 4,  # Adam's first step at full lr is sign-like: a KL spike
    'train.steps': RL_STEPS,
    # Held-out reward jumps between checkpoints 10 steps apart, so the RL row is the
    # checkpoint of best validation reward: 128 train-split problems outside the RL prompts,
    # greedy, every 10 steps. The test split only scores the chosen one (and the final one).
    'eval.every': SELECT_EVERY,
    'eval.batches': 4,
    'rl.eval_split': 'valid',
    'checkpoint.every': SELECT_EVERY,
    'checkpoint.keep': RL_STEPS // SELECT_EVERY,
  },
  # The preference route's stages read the task's pairs (demo.write_pair_sets): a worked
  # solution over another problem's; held-out pairs from the test split, scored at the end.
  'vrpo': {
    'train.steps': 40,
    'train.global_batch_size': 16,
    'train.micro_batch_size': 16,
    'train.lr': 1e-4,
    'eval.every': 40,
    'eval.batches': 4,
    'checkpoint.every': 0,
  },
  'reward': {
    'train.steps': 60,
    'train.global_batch_size': 16,
    'train.micro_batch_size': 16,
    'train.lr': 1e-3,
    'eval.every': 60,
    'eval.batches': 8,
    'checkpoint.every': 0,
  },
}

# The RL stage's objective on top of the recipe. SPG trains without a KL term, so it gets lr
# 3e-5, the stable end of the GPU search (1e-4 collapses without KL). Each objective has its own
# RL run directory; all start from the same SFT checkpoints.
OBJECTIVES = {
  'd1': {},
  'espo': {'rl.objective': 'espo'},
  'spg': {'rl.objective': 'spg', 'rl.kl_beta': 0.0, 'train.lr': 3e-5},
  # wd1 has no KL term and no clip: at d1's lr (3e-4) it collapses to reward 0 within 35 steps,
  # at 3e-5 it gains the most of the three; coupled-GRPO keeps d1's beta, clip and lr
  # (docs/benchmarks.md, RL objectives).
  'wd1': {'rl.objective': 'wd1', 'rl.kl_beta': 0.0, 'train.lr': 3e-5},
  # wd1++: wd1's settings on every decoding step's prediction, at the lr that held the SFT model
  # (higher lrs degraded it: docs/benchmarks.md, RL objectives).
  'wd1pp': {'rl.objective': 'wd1pp', 'rl.kl_beta': 0.0, 'train.lr': 3e-6},
  'coupled_grpo': {'rl.objective': 'coupled_grpo'},
}


def canvas_overrides(task: str) -> dict:
  """Per stage, the keys TASK_CANVAS sets: seq_len everywhere, the RL sampler's widths and steps."""
  if task not in TASK_CANVAS:
    raise ValueError(f'--task {task!r}: the demo is sized for {sorted(TASK_CANVAS)}.')
  prompt, gen = TASK_CANVAS[task]
  canvas = {'model.seq_len': prompt + gen}
  return {
    'pretrain': canvas,
    'sft': canvas,
    'vrpo': canvas,
    'reward': canvas,
    'rl': {
      **canvas,
      'rl.max_prompt_tokens': prompt,
      'sampler.gen_length': gen,
      'sampler.steps': gen // 2,
      'sampler.block_length': gen,
    },
  }


def recipe(objective: str = 'd1', task: str = 'sudoku4') -> dict:
  """{stage: {dotted key: value}}: the recipe sized for `task`, its RL stage on `objective`."""
  if objective not in OBJECTIVES:
    raise ValueError(f'--objective {objective!r}: choose one of {sorted(OBJECTIVES)}.')
  keys = copy.deepcopy(STAGE_RECIPE)
  for stage, canvas in canvas_overrides(task).items():
    keys[stage].update(canvas)
  keys['rl'].update(OBJECTIVES[objective])
  return keys


def get_config(arg='rl'):
  """One stage's config: "STAGE[,TASK[,OBJECTIVE]]" (task sudoku4, objective d1 by default)."""
  from dlmjax import demo  # pylint: disable=import-outside-toplevel

  stage, task, objective = (arg.split(',') + ['', ''])[:3]
  task, objective = task or 'sudoku4', objective or 'd1'
  if stage not in BASE_CONFIGS:
    raise ValueError(f'configs/demo.py:{arg}: the stage is one of {tuple(BASE_CONFIGS)}.')
  config = demo.base_config(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), BASE_CONFIGS[stage]),
    recipe(objective, task)[stage],
  )
  if stage == 'rl':
    config.rl.task = task
  if stage == 'sft':  # the task's own built-in rows (configs/sft.py reads sudoku4's)
    config.sft.train_file = f'builtin:{task}'
  return config
