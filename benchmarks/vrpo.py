"""VRPO's GPU table (docs/preference.md): quality over seeds, the step's speed beside SFT's, and
the 8B LoRA shape's memory and speed.

    python -m benchmarks.vrpo quality --work-dir runs/vrpo_quality --seeds 0,1,2 --lora-ranks 0,16
    python -m benchmarks.vrpo quality --tiny --work-dir /tmp/vrpo_quality_tiny     # CPU: it runs
    python -m benchmarks.vrpo speed --preset qwen3_0p6b --seq 512 --batch 16    # full fine-tuning
    python -m benchmarks.vrpo speed --preset llada_8b --seq 2048 --batch 4 --lora-rank 128
    python -m benchmarks.vrpo speed --tiny                                       # CPU: it runs
    python -m benchmarks.vrpo speed --preset qwen3_0p6b --seq 512 --batch 16 --stages sft,reward

quality: the demo's preference route (dlmjax/demo/, configs/demo.py; --task, arithmetic by
default) at --preset's shape: pre-training on the built-in corpus, SFT on the task's worked train
problems, then VRPO and a reward model (configs/reward.py's recipe, VRPO's size) on the task's
pairs (preference_rows.task_pairs, --pairs: 'other', a worked solution over another problem's;
'near_miss', over its own with a plausible wrong final answer) per --lora-ranks variant (0: full
fine-tuning) and --seeds seed, each from the one SFT model. A preset gives the shape only: the
tokenizer (vocabulary and special ids) stays the built-in one, which the offline data is written
in.
--init-from RUN skips the first two stages and starts VRPO from RUN (of the same shape). Stages
finished under --work-dir are skipped and a stopped one (a time limit's SIGTERM: the trainer
checkpoints its step) resumes, so one command can be repeated until it prints the table. Per
variant the table gives the held-out pairs' figures, mean +- std (ddof 1) over seeds: before
(val_reference_elbo_accuracy: the SFT model ranks chosen above rejected) and after VRPO
(val_elbo_accuracy, val_margin, val_preference_accuracy); a second table gives the reward
model's held-out accuracy before (the SFT model with the run's fresh head) and after; then one
JSON line with every seed's. Each finished run's figures stay in its directory (quality.json) and
its checkpoints are removed (--keep-checkpoints keeps them). --override [STAGE:]KEY=VALUE
(repeatable; STAGE pretrain, sft, vrpo, reward, a variant's VRPO runs: full, lora16, ..., or its
reward runs: reward_full, ...) sets a config key in every stage or in one. --tiny: a 2-layer
model, a few steps of each, on the CPU.

speed: dlmjax.bench's timing of the real compiled step on random pairs, for SFT and
for VRPO at the same model, canvas and batch, plus the reference's scoring that VRPO's batch
source adds before each step. It prints one JSON line: tokens/s counted as rows x seq_len (a
VRPO row is a pair, so 2 x seq_len tokens go through the model per row and per ELBO copy), the
peak memory and the compile time. --stages sft,reward times the reward model's step instead (a
reward row is a pair too: 2 x seq_len tokens, one clean forward each).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time

import numpy as np

# The model fields a preset may not set here: the tokenizer's (the built-in data's ids) and the
# canvas (the task's, configs/demo.py TASK_CANVAS).
TOKENIZER_FIELDS = ('vocab_size', 'mask_token_id', 'eos_token_id', 'pad_token_id', 'seq_len')
# On top of the demo's preference route, at a preset's shape on one GPU. The demo's rates are
# for its 5.5M model: a 28-layer model takes GPT-3's rate for its size (3e-4 at 350M-760M), and
# VRPO a tenth of the demo's; SFT sees each of its problems about once (at 4,000 problems a
# longer SFT overfits: docs/benchmarks.md, sampler accuracy), in batches that fill the GPU more.
GPU_RECIPE = {
  # Each run saves its last step only (and the step a stop signal cut); keep 1 lets the disk check
  # count two 5.3 GB checkpoints a run, not four, on a 64 GB disk holding five such runs.
  '': {'model.dtype': 'bfloat16', 'checkpoint.keep': 1},
  'pretrain': {'train.lr': 3e-4, 'train.min_lr': 3e-5, 'train.micro_batch_size': 32},
  'sft': {
    'train.steps': 600,
    'train.global_batch_size': 64,
    'train.micro_batch_size': 64,
    'train.lr': 3e-4,
    'train.min_lr': 3e-5,
    'train.warmup_steps': 20,
    'train.wsd_decay_steps': 60,
  },
  'vrpo': {'train.lr': 1e-5, 'eval.batches': 8},  # 128 held-out pairs
  # configs/reward.py's rate (LoRA's is LORA_LR_FACTOR x, as there), sized like VRPO's runs.
  'reward': {'train.steps': 40, 'train.lr': 1e-4, 'eval.every': 40, 'eval.batches': 8},
}
GPU_SFT_EXAMPLES = 40_000
# --tiny: the test suite's 2-layer shape (tests/conftest.py), a few steps of each stage.
TINY_RECIPE = {
  '': {
    'model.num_layers': 2,
    'model.d_model': 64,
    'model.num_heads': 4,
    'model.num_kv_heads': 2,
    'model.head_dim': 16,
    'model.ffn_dim': 128,
    'train.global_batch_size': 8,
    'train.micro_batch_size': 8,
  },
  'pretrain': {'train.steps': 1, 'train.warmup_steps': 0, 'train.wsd_decay_steps': 1},
  'sft': {'train.steps': 2, 'train.warmup_steps': 1, 'train.wsd_decay_steps': 1},
  'vrpo': {'train.steps': 2, 'eval.every': 2, 'eval.batches': 1, 'preference.budget': 2},
  'reward': {'train.steps': 2, 'eval.every': 2, 'eval.batches': 1},
}
TINY_SFT_EXAMPLES = 64
# Adapters start at zero and move the model only through their low-rank product, so they train
# at 10x full fine-tuning's rate, alpha 2 x rank (configs/sft.py's LoRA recipe and its measure).
LORA_LR_FACTOR = 10.0
# Before (the SFT model, VRPO's reference), then after.
QUALITY_KEYS = (
  'val_reference_elbo_accuracy',
  'val_elbo_accuracy',
  'val_margin',
  'val_preference_accuracy',
)
QUALITY_HEADER = (
  'before: ELBO accuracy (SFT)',
  'after: ELBO accuracy',
  'margin',
  'preference accuracy',
)
# The reward model's held-out pairs: before (the SFT model with the run's fresh score head), after.
REWARD_KEYS = ('reward_accuracy_before', 'val_reward_accuracy', 'val_margin')
REWARD_HEADER = ('before: reward accuracy (SFT + fresh head)', 'after: reward accuracy', 'margin')
# Each finished VRPO or reward run's figures, kept in its directory: a rerun reads them, and its
# checkpoints can go (--keep-checkpoints keeps them): eight 5.3 GB full runs overfill a 64 GB disk.
FIGURES = 'quality.json'


def _ints(text: str, flag: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(',') if v.strip()]
  except ValueError:
    values = []
  if not values or len(set(values)) != len(values) or min(values) < 0:
    raise ValueError(f'{flag} {text!r}: give distinct non-negative integers, e.g. {flag} 0,16.')
  return values


def variant_name(rank: int) -> str:
  return 'full' if rank == 0 else f'lora{rank}'


def quality_configs(args) -> dict:
  """{name: config} in training order: pretrain and sft (unless --init-from), then per variant
  and seed one VRPO config ('full/seed0', 'lora16/seed0', ...) and one reward-model config
  ('reward_full/seed0', ...), each from the SFT run, on the --pairs kind of pairs."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import demo  # pylint: disable=import-outside-toplevel
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  from benchmarks import sampler_accuracy  # pylint: disable=import-outside-toplevel

  if not args.tiny and args.preset not in presets.PRESETS:
    raise ValueError(f'--preset {args.preset!r}: choose one of {sorted(presets.PRESETS)}.')
  recipe = TINY_RECIPE if args.tiny else GPU_RECIPE

  def stage_config(c, stage: str):
    if not args.tiny:
      shape = {k: v for k, v in presets.PRESETS[args.preset].items() if k not in TOKENIZER_FIELDS}
      config_lib.set_model_fields(c.model, shape)
    for keys in (recipe[''], recipe[stage], sampler_accuracy.overrides_of(args.override, stage)):
      config_lib.apply_overrides(c, keys, presets=presets.PRESETS)
    return c

  stages = demo.stage_configs(0, args.work_dir, args.task, route='vrpo', pairs=args.pairs)
  stages['reward'] = demo.stage_configs(
    0, args.work_dir, args.task, route='reward', pairs=args.pairs
  )['reward']
  configs = {} if args.init_from else {s: stage_config(stages[s], s) for s in ('pretrain', 'sft')}
  suffix = demo.pairs_suffix(args.pairs)
  for rank in _ints(args.lora_ranks, '--lora-ranks'):
    variant = variant_name(rank)
    for seed in demo.parse_seeds(args.seeds):
      for stage in ('vrpo', 'reward'):
        c = stage_config(copy.deepcopy(stages[stage]), stage)
        c.seed, c.init_from = seed, args.init_from or stages['sft'].output_dir
        c.output_dir = os.path.join(args.work_dir, f'{stage}_{variant}{suffix}', f'seed{seed}')
        if rank:
          c.train.lora.rank, c.train.lora.alpha = rank, 2.0 * rank
          c.train.lr = LORA_LR_FACTOR * c.train.lr
          c.train.min_lr = LORA_LR_FACTOR * c.train.min_lr
        name = variant if stage == 'vrpo' else f'reward_{variant}'
        config_lib.apply_overrides(c, sampler_accuracy.overrides_of(args.override, name))
        configs[f'{name}/seed{seed}'] = c
  for c in configs.values():
    config_lib.validate(c)
  return configs


def _compile_once(work_dir: str) -> None:
  """Seeds (and a resumed command) compile the same programs: a persistent compilation cache
  under the work dir loads them after the first (JAX_COMPILATION_CACHE_DIR, if set, wins)."""
  import jax  # pylint: disable=import-outside-toplevel

  if not (os.environ.get('JAX_COMPILATION_CACHE_DIR') or jax.config.jax_compilation_cache_dir):
    jax.config.update('jax_compilation_cache_dir', os.path.join(work_dir, 'jax_cache'))


def _figures(config) -> dict:
  """A finished run's held-out figures: VRPO's last evaluation, or the reward model's accuracy
  before and after training (demo.reward_model_accuracy)."""
  from dlmjax import demo  # pylint: disable=import-outside-toplevel

  if config.stage == 'reward':
    scored = demo.reward_model_accuracy(config)
    return dict(
      step=config.train.steps,
      pairs=scored['pairs'],
      reward_accuracy_before=scored['before']['accuracy'],
      val_reward_accuracy=scored['after']['accuracy'],
      val_margin=scored['after']['margin'],
    )
  last = [r for r in demo.metric_rows(config.output_dir) if 'val_margin' in r][-1]
  return dict(step=last['step'], **{k: last[k] for k in QUALITY_KEYS})


def _run_figures(config, name: str, keep_checkpoints: bool) -> dict:
  """Trains the run unless its figures are there, then scores it once (FIGURES)."""
  from benchmarks import sampler_accuracy  # pylint: disable=import-outside-toplevel

  path = os.path.join(config.output_dir, FIGURES)
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  sampler_accuracy.train_if_needed(config, name)
  row = dict(seed=config.seed, **_figures(config))
  with open(path, 'w') as f:
    json.dump(row, f)
  if not keep_checkpoints:
    shutil.rmtree(os.path.join(config.output_dir, 'checkpoints'), ignore_errors=True)
  return row


def _quality(args) -> dict:
  from dlmjax import demo  # pylint: disable=import-outside-toplevel

  from benchmarks import sampler_accuracy  # pylint: disable=import-outside-toplevel

  configs = quality_configs(args)  # bad input fails here, before anything trains
  _compile_once(args.work_dir)
  if not args.init_from:
    examples = args.sft_examples or (TINY_SFT_EXAMPLES if args.tiny else GPU_SFT_EXAMPLES)
    demo.write_sft_set(configs['sft'].sft.train_file, args.task, num=examples)
  demo.write_pair_sets(args.work_dir, args.task, pairs=args.pairs)
  variants = {}
  for name, config in configs.items():
    if '/' not in name:
      sampler_accuracy.train_if_needed(config, name)
      continue
    row = _run_figures(config, name, args.keep_checkpoints)
    print(json.dumps(dict(run=name, **row)), flush=True)
    variants.setdefault(name.split('/')[0], []).append(row)
  summary = {
    variant: {
      k: _mean_std([r[k] for r in rows])
      for k in (REWARD_KEYS if variant.startswith('reward_') else QUALITY_KEYS)
    }
    for variant, rows in variants.items()
  }
  print(quality_table(summary), flush=True)
  return dict(
    part='quality',
    task=args.task,
    pairs=args.pairs,
    preset='tiny' if args.tiny else args.preset,
    init_from=args.init_from or configs['sft'].output_dir,
    per_seed=variants,
    summary=summary,
  )


def _mean_std(values) -> dict:
  """Mean and the sample standard deviation (ddof 1: the spread a new seed would show)."""
  std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  return dict(mean=float(np.mean(values)), std=std, n=len(values))


def quality_table(summary: dict) -> str:
  """Markdown, mean +- std over seeds: per variant, before (the SFT model) and after VRPO; then
  per variant, the reward model's held-out accuracy before (the fresh head) and after training."""
  tables = []
  for keys, header, reward in (
    (QUALITY_KEYS, QUALITY_HEADER, False),
    (REWARD_KEYS, REWARD_HEADER, True),
  ):
    rows = {v: stats for v, stats in summary.items() if v.startswith('reward_') == reward}
    if not rows:
      continue
    lines = [
      f'| {"reward model" if reward else "variant"} | seeds | ' + ' | '.join(header) + ' |',
      '| --- | ---: |' + ' ---: |' * len(keys),
    ]
    for variant, stats in rows.items():
      cells = [f'{stats[k]["mean"]:.3f} +- {stats[k]["std"]:.3f}' for k in keys]
      name = variant.removeprefix('reward_')
      lines.append(f'| {name} | {stats[keys[0]]["n"]} | ' + ' | '.join(cells) + ' |')
    tables.append('\n'.join(lines))
  return '\n\n'.join(tables)


def _config(args, stage: str):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  c = config_lib.defaults()
  c.stage = stage
  c.init_from = 'random-weights'  # validation only: init_state draws the weights
  if args.tiny:
    c.model.num_layers, c.model.d_model, c.model.ffn_dim = 2, 64, 128
    c.model.num_heads = c.model.num_kv_heads = 4
    c.model.head_dim, c.model.vocab_size = 16, 256
    c.model.mask_token_id, c.model.eos_token_id, c.model.pad_token_id = 255, 254, 254
  else:
    presets.apply_preset(c.model, args.preset)
    c.model.dtype = 'bfloat16'
    c.model.remat = args.remat
  c.model.seq_len = args.seq
  c.model.loss_chunk_tokens = 0 if args.tiny else min(2048, args.micro * args.seq)
  c.train.global_batch_size, c.train.micro_batch_size = args.batch, args.micro
  c.train.warmup_steps = c.train.wsd_decay_steps = 0
  c.train.schedule = 'constant'
  c.train.check_memory = False
  c.train.lora.rank = args.lora_rank
  c.preference.budget = args.budget
  return config_lib.apply_overrides(c, [])


def _speed(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import vrpo  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train.stages import preference  # pylint: disable=import-outside-toplevel

  result = dict(part='speed', preset='tiny' if args.tiny else args.preset, lora=args.lora_rank)
  stages = args.stages.split(',')
  for stage in stages:
    config = _config(args, stage)
    result[stage] = bench.run(config, steps=args.steps, warmup=1, matmul=False)
    # On stderr as it comes: a later stage failing (out of memory) keeps this one's figures.
    print(json.dumps({stage: result[stage]}), file=sys.stderr, flush=True)
  if 'preference' not in stages:
    return result
  # The reference's ELBOs that the batch source scores before each VRPO step.
  config = _config(args, 'preference')
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  params = setup.model_params(setup.init_state(config.seed)['params'])
  scorer = preference.Scorer(config, setup, setup.model_config)
  batch = preference.stage(config).example_batch(np.random.default_rng(0))
  jax.block_until_ready(scorer(params, batch, vrpo.POLICY_STREAM))
  start = time.perf_counter()
  for _ in range(args.steps):
    jax.block_until_ready(scorer(params, batch, vrpo.POLICY_STREAM))
  reference_s = (time.perf_counter() - start) / args.steps
  step_s = result['preference']['step_time_s'] + reference_s
  result['preference_reference_s'] = round(reference_s, 4)
  result['preference_tokens_per_s_with_reference'] = round(args.batch * args.seq / step_s)
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.vrpo',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('part', choices=('quality', 'speed'))
  parser.add_argument('--init-from', default='', help='quality: an SFT run (default: train one)')
  parser.add_argument('--work-dir', default='runs/vrpo_quality', help='quality: every run')
  parser.add_argument('--task', default='arithmetic', help="quality: the demo's task")
  parser.add_argument('--seeds', default='0,1,2', help='quality: one VRPO run per seed')
  parser.add_argument('--lora-ranks', default='0,16', help='quality: 0 is full fine-tuning')
  parser.add_argument('--sft-examples', type=int, help='quality: worked train problems for SFT')
  parser.add_argument('--override', action='append', default=[], help='quality: [STAGE:]KEY=VALUE')
  parser.add_argument(
    '--pairs',
    default='other',
    help="quality: the pairs' rejected responses, other (another problem's solution) or "
    "near_miss (the problem's own solution with a plausible wrong final answer)",
  )
  parser.add_argument(
    '--keep-checkpoints',
    action='store_true',
    help="quality: keep each VRPO and reward run's checkpoints once its figures are saved",
  )
  parser.add_argument('--tiny', action='store_true', help='a 2-layer model on the CPU')
  parser.add_argument('--preset', default='qwen3_0p6b', help="the model's shape")
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--batch', type=int, default=8, help='rows (pairs) per step')
  parser.add_argument('--micro', type=int, default=0, help='rows per micro-batch (0: --batch)')
  parser.add_argument('--lora-rank', type=int, default=0)
  parser.add_argument('--budget', type=int, default=8, help='preference.budget')
  parser.add_argument('--remat', default='full')
  parser.add_argument('--steps', type=int, default=5, help='timed steps')
  parser.add_argument(
    '--stages',
    default='sft,preference',
    help='speed: the stages timed, of sft, preference (VRPO) and reward (the reward model)',
  )
  args = parser.parse_args(argv)
  args.micro = args.micro or args.batch
  if args.part == 'speed':
    print(json.dumps(_speed(args)), flush=True)
    return 0
  from dlmjax import cli  # pylint: disable=import-outside-toplevel

  try:
    result = _quality(args)
  except InterruptedError as e:  # caught before OSError, its base class
    print(f'stopped: {e}', file=sys.stderr)
    return 3
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps(result), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
