"""python -m benchmarks.sampler_accuracy [--task arithmetic] [--work-dir DIR] [options]

Held-out accuracy, mean reward and generated tokens/s of the three-stage demo's SFT and RL
checkpoints under Fast-dLLM's four decoding settings: none (no cache, one token per step),
dual (the dual K/V cache), threshold (commit every token at least --threshold confident) and
both. The demo's held-out problems and greedy rollout sampler (dlmjax.demo: eval_sampling); the
RL row is its checkpoint of best validation reward. Stages missing under --work-dir are trained
first with the demo's recipe (seed 0; --pretrain-steps / --sft-steps / --rl-steps; on the 2-core
CPU about 10 minutes for the demo's counts). Each setting is evaluated twice, the second time
with its program compiled: its seconds give tokens/s (problems x gen_length / s, so a setting
that commits several tokens per step shows there). One table last.

  python -m benchmarks.sampler_accuracy --task arithmetic            # train if needed, evaluate
  python -m benchmarks.sampler_accuracy --task countdown3 --eval-num 64
  python -m benchmarks.sampler_accuracy --tiny                      # a CPU check: 2 + 8 + 2 steps
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

from dlmjax import config as config_lib
from dlmjax import demo
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.train import loop

SETTINGS = ('none', 'dual', 'threshold', 'both')


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.sampler_accuracy',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--task', default='arithmetic')
  parser.add_argument('--work-dir', default='runs/sampler_accuracy')
  parser.add_argument('--settings', default=','.join(SETTINGS))
  parser.add_argument('--threshold', type=float, default=0.9, help="Fast-dLLM's 0.9")
  parser.add_argument('--stages', default='sft,rl')
  parser.add_argument('--eval-num', type=int, default=demo.EVAL_EXAMPLES)
  parser.add_argument('--pretrain-steps', type=int)
  parser.add_argument('--sft-steps', type=int)
  parser.add_argument('--rl-steps', type=int)
  parser.add_argument('--tiny', action='store_true', help='2 + 8 + 2 steps, 16 problems')
  return parser


def _trained(configs, stages, args) -> dict:
  """Each stage's run directory, trained first where no finished checkpoint is there."""
  steps = dict(pretrain=args.pretrain_steps, sft=args.sft_steps, rl=args.rl_steps)
  demo.write_sft_set(configs['sft'].sft.train_file, args.task)
  dirs = {}
  for stage in demo.STAGES:
    config = configs[stage]
    if steps[stage]:
      n = steps[stage]
      overrides = {'train.steps': n, 'train.wsd_decay_steps': max(1, n // 10)}
      if stage == 'rl':
        overrides = {'train.steps': n, 'train.warmup_steps': min(config.train.warmup_steps, n // 2)}
        overrides |= {'eval.every': n, 'checkpoint.every': n}  # scored (and kept) at the end
      config_lib.apply_overrides(config, overrides)
    try:
      saved = checkpoint_lib.resolve_step_dir(config.output_dir)[2]
    except checkpoint_lib.CheckpointError:
      saved = -1
    if saved < config.train.steps:
      print(f'== training {stage} -> {config.output_dir}', flush=True)
      loop.train(config)
    dirs[stage] = config.output_dir
  return {s: demo.best_checkpoint(d) if s == 'rl' else d for s, d in dirs.items() if s in stages}


def _sampling(base, setting, threshold):
  cache = 'dual' if setting in ('dual', 'both') else 'none'
  return dataclasses.replace(
    base, cache=cache, threshold=threshold if setting in ('threshold', 'both') else 0.0
  )


def _table(rows) -> str:
  head = ('stage', 'setting', 'accuracy', 'mean reward', 'eval s', 'tokens/s', 'x none')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    lines.append(
      ' | '.join(
        (
          r['stage'],
          r['setting'],
          f'{r["accuracy"]:.3f}',
          f'{r["mean_reward"]:.3f}',
          f'{r["eval_s"]:.1f}',
          f'{r["tokens_per_s"]:.1f}',
          f'{r["speedup"]:.2f}',
        )
      )
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.tiny:
    args.pretrain_steps, args.sft_steps, args.rl_steps = 2, 8, 2
    args.eval_num = min(args.eval_num, 16)
  settings = [s.strip() for s in args.settings.split(',') if s.strip()]
  stages = [s.strip() for s in args.stages.split(',') if s.strip()]
  bad = sorted(set(settings) - set(SETTINGS)) + sorted(set(stages) - {'sft', 'rl'})
  if bad or 'none' not in settings:
    print(
      f'error: --settings from {SETTINGS} with none, --stages from sft,rl; got {bad}',
      file=sys.stderr,
    )
    return 2
  configs = demo.stage_configs(0, args.work_dir, args.task)
  base = demo.eval_sampling(configs['rl'])
  dirs = _trained(copy.deepcopy(configs), stages, args)
  rows = []
  for stage, run_dir in dirs.items():
    none_s = None
    for setting in ['none'] + [s for s in settings if s != 'none']:
      sampling = _sampling(base, setting, args.threshold)
      demo.evaluate_stage(run_dir, args.task, sampling=sampling, num=args.eval_num)  # compiles
      start = time.perf_counter()
      scores = demo.evaluate_stage(run_dir, args.task, sampling=sampling, num=args.eval_num)
      seconds = time.perf_counter() - start
      none_s = none_s or seconds
      row = dict(stage=stage, setting=setting, accuracy=scores['accuracy'])
      row.update(mean_reward=scores['mean_reward'], eval_s=seconds, speedup=none_s / seconds)
      row['tokens_per_s'] = scores['examples'] * sampling.gen_length / seconds
      print(row, flush=True)
      rows.append(row)
  print(
    f'{args.task}: {args.eval_num} held-out problems, greedy, gen {base.gen_length}, block '
    f'{base.block_length}, {base.steps} steps; threshold {args.threshold}; {args.work_dir}'
  )
  print(_table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
