"""python -m benchmarks.sampler_accuracy [--task arithmetic] [--work-dir DIR] [options]

Held-out accuracy, mean reward and generated tokens/s of the three-stage demo's SFT and RL
checkpoints under Fast-dLLM's four decoding settings: none (no cache, one token per step),
dual (the dual K/V cache), threshold (commit every token at least --threshold confident) and
both. The demo's held-out problems and greedy rollout sampler (dlmjax.demo: eval_sampling); the
RL row is its checkpoint of best validation reward. Stages missing under --work-dir are trained
first with the demo's recipe (seed 0; --pretrain-steps / --sft-steps / --rl-steps, and
--sft-examples problems in the SFT set; on the 2-core CPU about 10 minutes for the demo's
counts). Each setting is evaluated twice, the second time with its program compiled: its seconds
give tokens/s (problems x gen_length / s, so a setting that commits several tokens per step
shows there). One table last.

  python -m benchmarks.sampler_accuracy --task arithmetic            # train if needed, evaluate
  python -m benchmarks.sampler_accuracy --task countdown3 --eval-num 64
  python -m benchmarks.sampler_accuracy --tiny                      # a CPU check: 2 + 8 + 2 steps

--override [STAGE:]KEY=VALUE (repeatable) sets a config key in every stage or in one (a larger
model, the sampler's blocks, SFT's lr), so a GPU run can train a model confident enough to show
what a setting costs.
--rl-cache none,dual also trains the RL stage once per sampler cache mode (from the same SFT
checkpoint, run directories rl_cache_<mode>) and prints a second table: seconds per RL step and
rollout, the rollout reward over the run, and the held-out score of each run's best checkpoint
(decoded as `none`): what a cached sampler does to RL's stability and result.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import sys
import time

from dlmjax import config as config_lib
from dlmjax import demo
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.model import presets
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
  parser.add_argument(
    '--sft-examples', type=int, default=demo.SFT_EXAMPLES, help='worked train-split problems'
  )
  parser.add_argument('--tiny', action='store_true', help='2 + 8 + 2 steps, 16 problems')
  parser.add_argument('--override', action='append', default=[], help='[STAGE:]KEY=VALUE')
  parser.add_argument('--rl-cache', default='', help='cache modes to train the RL stage with')
  return parser


def stage_overrides(config, stage, n) -> None:
  """--STAGE-steps N: the stage shortened to N steps, its schedule (and RL's scoring) with it."""
  if stage == 'rl':
    overrides = {'train.steps': n, 'train.warmup_steps': min(config.train.warmup_steps, n // 2)}
    overrides |= {'eval.every': n, 'checkpoint.every': n}  # scored (and kept) at the end
  else:
    overrides = {'train.steps': n, 'train.wsd_decay_steps': max(1, n // 10)}
  config_lib.apply_overrides(config, overrides)


def overrides_of(overrides: list[str], stage: str) -> list[str]:
  """The --override [STAGE:]KEY=VALUE items that apply to `stage` (no STAGE: every stage), as
  KEY=VALUE."""
  return [o.split(':', 1)[-1] for o in overrides if o.split(':', 1)[0] in (stage, o)]


def _saved_step(config) -> int:
  try:
    return run_dir_lib.resolve_step_dir(config.output_dir)[2]
  except run_dir_lib.CheckpointError:
    return -1


def train_if_needed(config, what: str) -> float:
  """Trains `config` unless its output_dir holds its final checkpoint; the wall seconds (nan when
  nothing was trained). A run stopped early by a signal (a time limit's SIGTERM: the trainer
  checkpoints the step in flight) raises InterruptedError, so the next stage never starts from
  an unfinished one."""
  if _saved_step(config) >= config.train.steps:
    return float('nan')
  print(f'== training {what} -> {config.output_dir}', flush=True)
  start = time.perf_counter()
  loop.train(config)
  saved = _saved_step(config)
  if saved < config.train.steps:
    where = f'at step {saved} of {config.train.steps}' if saved >= 0 else 'before its first step'
    raise InterruptedError(f'{what} stopped {where}; the same command resumes it from there.')
  return time.perf_counter() - start


def stopped_in_one_line(body):
  """body(argv) -> exit code, as a benchmark's main whose stages run through train_if_needed: a
  stage a time limit stopped (InterruptedError, its step checkpointed) ends the chain with one
  line and exit 3, not a trace; the same command resumes it."""

  @functools.wraps(body)
  def main(argv=None) -> int:
    try:
      return body(argv)
    except InterruptedError as e:
      print(f'stopped: {e}', file=sys.stderr)
      return 3

  return main


def _trained(configs, stages, args) -> dict:
  """Each evaluated stage's run directory; the stages up to the last one needed (--stages, and
  SFT for --rl-cache) are trained first where no finished checkpoint is there."""
  steps = dict(pretrain=args.pretrain_steps, sft=args.sft_steps, rl=args.rl_steps)
  demo.write_sft_set(configs['sft'].sft.train_file, args.task, num=args.sft_examples)
  needed = set(stages) | ({'sft'} if args.rl_cache.strip() else set())
  last = max(demo.STAGES.index(s) for s in needed)
  dirs = {}
  for stage in demo.STAGES[: last + 1]:
    if steps[stage]:
      stage_overrides(configs[stage], stage, steps[stage])
    train_if_needed(configs[stage], stage)
    dirs[stage] = configs[stage].output_dir
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


def _rl_cache_runs(rl_config, modes, args, base) -> list[dict]:
  """The RL stage trained once per sampler cache mode from the same SFT checkpoint; per run the
  step and rollout seconds (the first, compiling, step left out), the rollout reward curve and the
  held-out score of its best checkpoint decoded without a cache."""
  runs = []
  for mode in modes:
    config = copy.deepcopy(rl_config)
    config.output_dir = f'{rl_config.output_dir}_cache_{mode}'
    config_lib.apply_overrides(config, {'sampler.cache': mode})
    if args.rl_steps:
      stage_overrides(config, 'rl', args.rl_steps)
    elif mode == rl_config.sampler.cache:
      config.output_dir = rl_config.output_dir  # the RL stage's own run, when trained above
    wall = train_if_needed(config, f'rl with sampler.cache={mode}')
    rows = demo.metric_rows(config.output_dir)
    stepped = [r for r in rows if 'step_time_s' in r]
    rolled = [r for r in rows if 'generate_s' in r]
    stepped, rolled = stepped[1:] or stepped, rolled[1:] or rolled
    curve = [(r['step'], r['rollout_reward_mean']) for r in rows if 'rollout_reward_mean' in r]
    scores = demo.evaluate_stage(
      demo.best_checkpoint(config.output_dir), args.task, sampling=base, num=args.eval_num
    )
    run = dict(mode=mode, wall_s=wall, curve=curve, accuracy=scores['accuracy'])
    run.update(mean_reward=scores['mean_reward'])
    run['step_s'] = sum(r['step_time_s'] for r in stepped) / max(len(stepped), 1)
    run['generate_s'] = sum(r['generate_s'] for r in rolled) / max(len(rolled), 1)
    print({k: v for k, v in run.items() if k != 'curve'}, flush=True)
    runs.append(run)
  return runs


def _rl_cache_table(runs) -> str:
  head = ('rl sampler.cache', 'wall s', 's / step', 'generate s / rollout', 'held-out accuracy')
  head += ('held-out reward', 'rollout reward (first, max, last)')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in runs:
    rewards = [v for _, v in r['curve']] or [float('nan')]
    curve = f'{rewards[0]:.3f}, {max(rewards):.3f}, {rewards[-1]:.3f}'
    lines.append(
      f'{r["mode"]} | {r["wall_s"]:.0f} | {r["step_s"]:.3f} | {r["generate_s"]:.3f} | '
      f'{r["accuracy"]:.3f} | {r["mean_reward"]:.3f} | {curve}'
    )
  return '\n'.join(lines)


def _main(argv=None) -> int:
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
  for stage, config in configs.items():
    config_lib.apply_overrides(config, overrides_of(args.override, stage), presets=presets.PRESETS)
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
  modes = [m.strip() for m in args.rl_cache.split(',') if m.strip()]
  if modes:
    print(_rl_cache_table(_rl_cache_runs(configs['rl'], modes, args, base)))
  return 0


main = stopped_in_one_line(_main)


if __name__ == '__main__':
  sys.exit(main())
