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
accuracy against TPF per model; with --caches none,dual each rule also with the dual cache; and
d3LLM's multi-block decoding (sampler.block_add_threshold, uncached) at each
--block-add-thresholds value with each entropy threshold. Each
setting is evaluated twice, the second time compiled, for its seconds. Stages already finished
under --work-dir are reused and unfinished ones resume from their last checkpoint, so a run can
be split over commands (--train-only first) and a rerun only evaluates.

  python -m benchmarks.distill --task arithmetic --work-dir /tmp/distill      # GPU: the recipe
  python -m benchmarks.distill --tiny --work-dir /tmp/distill_tiny            # a CPU check

On one GPU within a short device budget, split it in two commands on one warm machine (the
work dir and JAX_COMPILATION_CACHE_DIR under runs/ stay between them): `timeout -s TERM 570 ...
--train-only` (the trainer checkpoints on the signal; repeat until it prints `trained:`), then the
same arguments without --train-only and with few settings (each setting compiles two programs,
the evaluation's and the commit-step record's; the students reuse the teacher's). Every row is
printed as it is measured, so a cut run keeps the rows it finished.

--keep correct distils only the teacher's rows that the task judges correct (dParallel; default
all, as d3LLM), --retries N decodes a wrong one again at a rising temperature (d3LLM: 4); the
rows and students of each choice get their own names under --work-dir (teacher_rows_correct.npz,
distill_certainty_correct). A teacher with no correct row leaves nothing to distil: the run stops
with that line (as the tiny CPU run's teacher, trained 8 steps, does).

--override [STAGE:]KEY=VALUE (repeatable; STAGE pretrain, sft or distill) sets a config key in
every stage or in one, as in the accuracy benchmark (a larger model, the sampler's blocks).
The last lines: the table, then the issue's numbers: the best student setting whose accuracy is
within 1 point of the teacher's `none` (its TPF, goal >= 4, and its x teacher none, goal >= 8
with the dual cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from benchmarks import sampler_accuracy
from dlmjax import config as config_lib
from dlmjax import decoding_table, demo
from dlmjax import distill as distill_cli
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.diffusion import distill as distill_objectives
from dlmjax.model import presets

STAGES = ('pretrain', 'sft', 'distill')
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
  parser.add_argument(
    '--block-add-thresholds', default='0.1', help="d3LLM's multi-block decoding (0.1; '' = off)"
  )
  parser.add_argument('--eval-num', type=int, default=demo.EVAL_EXAMPLES)
  parser.add_argument('--teacher-rows', type=int, default=4000, help='train problems decoded')
  parser.add_argument('--rows-batch', type=int, default=64, help='problems a teacher batch')
  parser.add_argument('--keep', choices=distill_cli.KEEP, default='all', help='rows distilled')
  parser.add_argument(
    '--retries',
    type=int,
    default=0,
    choices=range(len(distill_cli.RETRY_TEMPERATURES) + 1),
    help='tries more for a wrong row (d3LLM: 4)',
  )
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
  """{name: SamplingConfig} of every decoding setting, none first (decoding_table.settings_of)."""
  return decoding_table.settings_of(
    base,
    thresholds=_floats(args.thresholds),
    entropy_thresholds=_floats(args.entropy_thresholds),
    caches=[c.strip() for c in args.caches.split(',') if c.strip()],
    block_add_thresholds=_floats(args.block_add_thresholds),
  )


def stage_configs(args) -> dict:
  """The demo's pretrain and SFT configs (the teacher's recipe, as the accuracy benchmark's) and
  one distillation config per objective, --override applied; the sampler of every stage is the
  eval sampler's, so the students' distillation block is the block they are decoded with."""
  configs = demo.stage_configs(0, args.work_dir, args.task)
  base = demo.eval_sampling(configs['rl'])  # before the overrides, as the accuracy benchmark
  configs = {s: configs[s] for s in ('pretrain', 'sft')}
  teacher = args.teacher or configs['sft'].output_dir
  for objective in _objectives(args):
    c = demo.distill_config(
      configs['sft'], objective, args.work_dir, base, teacher, keep=args.keep, retries=args.retries
    )
    if args.teacher:  # its canvas, which its rows have (the demo's is sized for the task)
      run_dir = run_dir_lib.resolve_step_dir(args.teacher)[0]
      c.model.seq_len = run_dir_lib.load_run_config(run_dir).model.seq_len
    configs[f'distill_{objective}'] = c
  for name, config in configs.items():
    stage = 'distill' if name.startswith('distill') else name
    if stage != 'pretrain':
      config.checkpoint.every = CHECKPOINT_EVERY
    sampler = {f'sampler.{k}': getattr(base, k) for k in ('gen_length', 'steps', 'block_length')}
    config_lib.apply_overrides(config, sampler)
    mine = sampler_accuracy.overrides_of(args.override, stage)
    config_lib.apply_overrides(config, mine, presets=presets.PRESETS)
  return configs


def rows_kept(args, configs) -> str:
  """Which teacher rows the students distilled, for the table's header."""
  path = configs[f'distill_{_objectives(args)[0]}'].sft.teacher_file
  with np.load(path) as f:
    count = f['tokens'].shape[0]
  which = 'every teacher row' if args.keep == 'all' else "the teacher's correct rows"
  retries = f' --retries {args.retries}' if args.retries else ''
  return f'{which} (--keep {args.keep}{retries}: {count} of {args.teacher_rows} train problems)'


def _objectives(args) -> list[str]:
  names = [o.strip() for o in args.objectives.split(',') if o.strip()]
  for name in names:
    distill_objectives.get(name)  # an unknown one fails naming the known ones
  return names


def _main(argv=None) -> int:
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
    try:
      demo.write_teacher_rows(
        teacher,
        config.sft.teacher_file,
        base,
        args.task,
        num=args.teacher_rows,
        batch_size=args.rows_batch,
        keep=args.keep,
        retries=args.retries,
      )
    except RuntimeError as e:  # its reason is printed above it (none correct, a bad flag)
      print(f'error: no student to distil: {e}', file=sys.stderr)
      return 2
    if steps['distill']:
      sampler_accuracy.stage_overrides(config, 'distill', steps['distill'])
    sampler_accuracy.train_if_needed(config, f'distill ({objective})')
    models[objective] = config.output_dir
  if args.train_only:
    print(f'trained: {models}')
    return 0
  rows = demo.decoding_rows(models, args.task, settings, num=args.eval_num)
  print(
    f'{args.task}: {args.eval_num} held-out problems, greedy, gen {base.gen_length}, block '
    f'{base.block_length}, {base.steps} steps (none: {base.gen_length / base.steps:g} tokens a '
    f'step); teacher {teacher}; students {", ".join(list(models)[1:])} on '
    f'{rows_kept(args, configs)}'
  )
  print(decoding_table.table(rows))
  print(decoding_table.verdict(rows))
  return 0


main = sampler_accuracy.stopped_in_one_line(_main)


if __name__ == '__main__':
  sys.exit(main())
