"""python -m benchmarks.distill [--task arithmetic] [--work-dir DIR] [--teacher RUN] [options]

Trained parallel decoding, measured: a teacher (the accuracy benchmark's SFT model,
benchmarks/sampler_accuracy.py, trained here with its recipe unless --teacher names a run), its
rows (`python -m dlmjax.distill`: the teacher decoding the task's train problems with the eval
sampler, greedy), a student distilled from it per --objectives (sft.objective=certainty |
trajectory, README "Distillation"), then teacher vs students per decoding setting on the
held-out problems: accuracy (+- its standard error over the problems), tokens per step (TPF:
generated tokens / decoding steps that committed any, from the sampler's commit-step record),
steps per problem, generated tokens/s, x `none` (the same model's) and x teacher `none`.

Settings: none; Fast-dLLM's threshold at each --thresholds value; dParallel's entropy rule
(remasking=entropy, sampler.entropy_threshold) at each --entropy-thresholds value: a curve of
accuracy against TPF per model; with --caches none,dual each rule also with the dual cache. Each
setting is evaluated twice, the second time compiled, for its seconds. Stages already finished
under --work-dir are reused and unfinished ones resume from their last checkpoint, so a run can
be split over commands (--train-only first) and a rerun only evaluates.

  python -m benchmarks.distill --task arithmetic --work-dir /tmp/distill      # GPU: the recipe
  python -m benchmarks.distill --tiny --work-dir /tmp/distill_tiny            # a CPU check

--override [STAGE:]KEY=VALUE (repeatable; STAGE pretrain, sft or distill) sets a config key in
every stage or in one, as in the accuracy benchmark (a larger model, the sampler's blocks).
The last lines: the table, then the issue's numbers: the best student setting whose accuracy is
within 1 point of the teacher's `none` (its TPF, goal >= 4, and its x teacher none, goal >= 8
with the dual cache).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time

import numpy as np

from benchmarks import sampler_accuracy
from dlmjax import config as config_lib
from dlmjax import demo, inference
from dlmjax import distill as distill_cli
from dlmjax import tasks as tasks_lib
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.diffusion import distill as distill_objectives
from dlmjax.model import presets

STAGES = ('pretrain', 'sft', 'distill')
DISTILL_RECIPE = {  # dParallel's LLaDA recipe at this scale: a short fine-tune of the teacher
  'train.steps': 400,
  'train.lr': 1e-4,  # an SFT-ed model distils at a tenth of its SFT rate (dParallel: 2e-5, 8B)
  'train.min_lr': 1e-5,
  'train.warmup_steps': 20,
  'train.wsd_decay_steps': 40,
  'eval.every': 0,
}
# The SFT and distillation runs save this often, so a command cut by a time limit resumes there
# (the demo saves its short SFT only at the end).
CHECKPOINT_EVERY = 500


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.distill',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--task', default='arithmetic')
  parser.add_argument('--work-dir', default='runs/distill_bench')
  parser.add_argument('--teacher', default='', help='a trained run to distil (default: train one)')
  parser.add_argument('--objectives', default='certainty', help='sft.objective values, comma-sep')
  parser.add_argument('--thresholds', default='0.9,0.7,0.5', help="Fast-dLLM's (0.9)")
  parser.add_argument('--entropy-thresholds', default='0.25,0.5,1.0', help="dParallel's (0.5)")
  parser.add_argument('--caches', default='none,dual', help='none and/or dual')
  parser.add_argument('--eval-num', type=int, default=demo.EVAL_EXAMPLES)
  parser.add_argument('--teacher-rows', type=int, default=4000, help='train problems decoded')
  parser.add_argument('--rows-batch', type=int, default=64, help='problems a teacher batch')
  parser.add_argument('--pretrain-steps', type=int)
  parser.add_argument('--sft-steps', type=int)
  parser.add_argument('--distill-steps', type=int)
  parser.add_argument('--sft-examples', type=int, default=demo.SFT_EXAMPLES)
  parser.add_argument('--override', action='append', default=[], help='[STAGE:]KEY=VALUE')
  parser.add_argument('--tiny', action='store_true', help='2 + 8 + 4 steps, 16 problems (CPU)')
  parser.add_argument('--train-only', action='store_true', help='train what is missing, stop')
  return parser


def _floats(text: str) -> list[float]:
  return [float(v) for v in text.split(',') if v.strip()]


def settings_of(base, args) -> dict:
  """{name: SamplingConfig} of every decoding setting, none first."""
  caches = [c.strip() for c in args.caches.split(',') if c.strip()]
  out = {'none': dataclasses.replace(base, cache='none')}
  for cache in caches:
    prefix = '' if cache == 'none' else f'{cache}+'
    if cache != 'none':
      out[cache] = dataclasses.replace(base, cache=cache)
    for t in _floats(args.thresholds):
      out[f'{prefix}threshold {t:g}'] = dataclasses.replace(base, cache=cache, threshold=t)
    for h in _floats(args.entropy_thresholds):
      out[f'{prefix}entropy {h:g}'] = dataclasses.replace(
        base, cache=cache, remasking='entropy', entropy_threshold=h
      )
  return {name: s.validate() for name, s in out.items()}


def stage_configs(args) -> dict:
  """The demo's pretrain and SFT configs (the teacher's recipe, as the accuracy benchmark's) and
  one distillation config per objective, --override applied; the sampler of every stage is the
  eval sampler's, so the students' distillation block is the block they are decoded with."""
  configs = demo.stage_configs(0, args.work_dir, args.task)
  base = demo.eval_sampling(configs['rl'])  # before the overrides, as the accuracy benchmark
  configs = {s: configs[s] for s in ('pretrain', 'sft')}
  teacher = args.teacher or configs['sft'].output_dir
  for objective in _objectives(args):
    c = copy.deepcopy(configs['sft'])
    c.init_from = teacher
    if args.teacher:  # its canvas, which its rows have (the demo's is sized for the task)
      run_dir = checkpoint_lib.resolve_step_dir(args.teacher)[0]
      c.model.seq_len = checkpoint_lib.load_run_config(run_dir).model.seq_len
    c.output_dir = os.path.join(args.work_dir, f'distill_{objective}')
    c.sft.objective = objective
    c.sft.train_file = ''  # it trains on the teacher's rows alone
    c.sft.teacher_file = os.path.join(args.work_dir, 'teacher_rows.npz')
    config_lib.apply_overrides(c, DISTILL_RECIPE)
    configs[f'distill_{objective}'] = c
  for name, config in configs.items():
    stage = 'distill' if name.startswith('distill') else name
    if stage != 'pretrain':
      config.checkpoint.every = CHECKPOINT_EVERY
    sampler = {f'sampler.{k}': getattr(base, k) for k in ('gen_length', 'steps', 'block_length')}
    config_lib.apply_overrides(config, sampler)
    mine = [o.split(':', 1)[-1] for o in args.override if o.split(':', 1)[0] in (stage, o)]
    config_lib.apply_overrides(config, mine, presets=presets.PRESETS)
  return configs


def _objectives(args) -> list[str]:
  names = [o.strip() for o in args.objectives.split(',') if o.strip()]
  for name in names:
    distill_objectives.get(name)  # an unknown one fails naming the known ones
  return names


def teacher_rows(teacher: str, path: str, sampling, args) -> None:
  """The teacher's rows of --teacher-rows train problems (python -m dlmjax.distill)."""
  if os.path.isfile(path):
    return
  print(f'== teacher rows of {teacher} -> {path}', flush=True)
  overrides = []
  keys = ('gen_length', 'steps', 'block_length', 'cache', 'threshold', 'factor', 'remasking')
  for key in keys + ('entropy_threshold', 'stop_at_eos'):
    overrides += ['--override', f'{key}={getattr(sampling, key)}']
  argv = ['--init-from', teacher, '--output', path, '--task', args.task]
  argv += ['--num', str(args.teacher_rows), '--batch-size', str(args.rows_batch)]
  if distill_cli.main(argv + overrides):
    raise RuntimeError('python -m dlmjax.distill failed (its error is above)')


def steps_and_tpf(run_dir: str, task: str, sampling, num: int) -> tuple[float, float]:
  """(mean decoding steps per problem, generated tokens per step) of the held-out problems, from
  the sampler's commit-step record (the evaluation's problems, prompts and decoding key)."""
  pretrained = inference.load_pretrained(run_dir)
  examples = tasks_lib.get_task(task).examples('test', num, demo.EVAL_SEED)
  prompts = distill_cli.encode_prompts(
    pretrained, [e.prompt for e in examples], sampling.gen_length
  )
  rows = distill_cli.build_rows(
    pretrained, prompts, sampling, batch_size=demo.EVAL_BATCH, seed=demo.EVAL_SEED
  )
  steps = rows['commit_steps']
  per_row = np.array([len(np.unique(s[s >= 0])) for s in steps])
  return float(per_row.mean()), float((steps >= 0).sum() / max(per_row.sum(), 1))


def measure(run_dir: str, task: str, sampling, num: int) -> dict:
  demo.evaluate_stage(run_dir, task, sampling=sampling, num=num)  # compiles
  start = time.perf_counter()
  scores = demo.evaluate_stage(run_dir, task, sampling=sampling, num=num)
  seconds = time.perf_counter() - start
  p, n = scores['accuracy'], scores['examples']
  steps, tpf = steps_and_tpf(run_dir, task, sampling, num)
  return dict(
    accuracy=p,
    accuracy_se=math.sqrt(p * (1 - p) / max(n, 1)),
    tpf=tpf,
    steps=steps,
    tokens_per_s=n * sampling.gen_length / seconds,
  )


def table(rows) -> str:
  head = ('model', 'setting', 'accuracy', 'TPF', 'steps', 'tokens/s', 'x none', 'x teacher none')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    lines.append(
      f'{r["model"]} | {r["setting"]} | {r["accuracy"]:.3f} +- {r["accuracy_se"]:.3f} | '
      f'{r["tpf"]:.2f} | {r["steps"]:.1f} | {r["tokens_per_s"]:.1f} | {r["speedup"]:.2f} | '
      f'{r["vs_teacher"]:.2f}'
    )
  return '\n'.join(lines)


def verdict(rows) -> str:
  """The issue's numbers: the student settings within 1 point of the teacher's none."""
  floor = rows[0]['accuracy'] - 0.01
  kept = [r for r in rows if r['model'] != 'teacher' and r['accuracy'] >= floor]
  if not kept:
    best = max((r for r in rows if r['model'] != 'teacher'), key=lambda r: r['accuracy'])
    return (
      f'no student setting within 1 point of the teacher none ({rows[0]["accuracy"]:.3f}); the '
      f'most accurate: {best["model"]} {best["setting"]} {best["accuracy"]:.3f}'
    )
  by_tpf = max(kept, key=lambda r: r['tpf'])
  by_speed = max(kept, key=lambda r: r['vs_teacher'])
  return (
    f'within 1 point of the teacher none ({rows[0]["accuracy"]:.3f}): highest TPF '
    f'{by_tpf["tpf"]:.2f} ({by_tpf["model"]} {by_tpf["setting"]}, goal >= 4); fastest '
    f'{by_speed["vs_teacher"]:.2f}x teacher none ({by_speed["model"]} {by_speed["setting"]}, '
    'goal >= 8 with the dual cache)'
  )


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.tiny:
    args.pretrain_steps, args.sft_steps, args.distill_steps = 2, 8, 4
    args.eval_num, args.teacher_rows = min(args.eval_num, 16), min(args.teacher_rows, 32)
    args.rows_batch = min(args.rows_batch, 16)
    args.sft_examples = min(args.sft_examples, 200)
  try:
    configs = stage_configs(args)
    base = dataclasses.replace(
      demo.eval_sampling(configs['sft']), temperature=0.0, threshold=0.0, factor=0.0
    )
    settings = settings_of(base, args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  steps = dict(pretrain=args.pretrain_steps, sft=args.sft_steps, distill=args.distill_steps)
  if not args.teacher:
    demo.write_sft_set(configs['sft'].sft.train_file, args.task, num=args.sft_examples)
    for stage in ('pretrain', 'sft'):
      if steps[stage]:
        sampler_accuracy.stage_overrides(configs[stage], stage, steps[stage])
      sampler_accuracy.train_if_needed(configs[stage], stage)
  teacher = args.teacher or configs['sft'].output_dir
  models = {'teacher': teacher}
  for objective in _objectives(args):
    config = configs[f'distill_{objective}']
    teacher_rows(teacher, config.sft.teacher_file, base, args)
    if steps['distill']:
      sampler_accuracy.stage_overrides(config, 'distill', steps['distill'])
    sampler_accuracy.train_if_needed(config, f'distill ({objective})')
    models[objective] = config.output_dir
  if args.train_only:
    print(f'trained: {models}')
    return 0
  rows = []
  for model, run_dir in models.items():
    none_tps = None
    for name, sampling in settings.items():
      row = dict(model=model, setting=name, **measure(run_dir, args.task, sampling, args.eval_num))
      none_tps = none_tps or row['tokens_per_s']
      row['speedup'] = row['tokens_per_s'] / none_tps
      row['vs_teacher'] = row['tokens_per_s'] / (rows[0]['tokens_per_s'] if rows else none_tps)
      print(row, flush=True)
      rows.append(row)
  print(
    f'{args.task}: {args.eval_num} held-out problems, greedy, gen {base.gen_length}, block '
    f'{base.block_length}, {base.steps} steps (none: {base.gen_length / base.steps:g} tokens a '
    f'step); teacher {teacher}; students {", ".join(list(models)[1:])}'
  )
  print(table(rows))
  print(verdict(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
