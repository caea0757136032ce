"""python -m dlmjax.demo: pre-train -> SFT -> RL on the tiny model, each stage scored held-out.

  python -m dlmjax.demo [--seeds 0,1,2] [--output-dir runs/demo] [--task arithmetic]
                        [--objective d1|espo|spg|wd1|wd1pp|coupled_grpo] [--route rl|vrpo|reward]
                        [--pairs other|near_miss]
                        [--distill certainty|trajectory [--keep all|correct]]

Per seed, the three stages run through the normal trainer (`dlmjax.train.loop.train` on
configs/tiny.py, configs/sft.py and configs/rl.py with configs/demo.py's recipe on top), each
from the previous one's checkpoint. Every stage's checkpoint is then decoded greedily on the task's
held-out split with one sampler setting (dlmjax.evaluate's tasks mode) and checked with
dlmjax.verify; RL's is the one of best validation reward (train-split problems, every 10 steps).
The table gives per seed, then mean +- std over seeds: steps, final loss, held-out accuracy and
mean reward, and the RL gain over SFT against the seed-to-seed spread. It is also written to
OUTPUT_DIR/results.json (results_<objective>.json for the other objectives). A rerun resumes
finished or cut stages from their checkpoints; another --objective reuses the seeds' pre-training
and SFT runs and trains only its own RL stage (OUTPUT/seedN/rl_<objective>).

--distill OBJECTIVE adds a fourth stage per seed: the SFT model (the teacher, frozen) decodes
TEACHER_ROWS train problems (python -m dlmjax.distill), a student distils from it with
sft.objective=OBJECTIVE (OUTPUT/seedN/distill_<objective>), and a second table gives teacher vs
student per decoding setting (dlmjax/decoding_table.py: accuracy, tokens per forward, steps,
tokens/s, x none), as benchmarks/distill.py does on a larger model. With --keep correct the
student learns only from the teacher's rows the task judges correct (distill_<objective>_correct).

--route vrpo trains VRPO after SFT on the task's preference pairs (a worked solution over another
problem's); --route reward trains a reward model on them, then RL against it (rl.reward_model),
and reports the reward model's held-out pair accuracy before and after (docs/preference.md).
--pairs near_miss makes each pair's rejected response the problem's own worked solution with a
plausible wrong final answer (preference_rows.PAIR_KINDS), in its own runs (vrpo_near_miss, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dlmjax import cli
from dlmjax import distill as distill_cli
from dlmjax import decoding_table
from dlmjax import tasks as tasks_lib
from dlmjax.demo import distill_stage, routes, runs, sets, tables
from dlmjax.diffusion import distill as distill_objectives


def parse_seeds(text: str) -> list[int]:
  parts = [p.strip() for p in text.split(',')]
  if not text.strip() or not all(parts):
    raise ValueError(f'--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2.')
  try:
    seeds = [int(p) for p in parts]
  except ValueError:
    raise ValueError(
      f'--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2.'
    ) from None
  if len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f'--seeds {text!r}: seeds must be distinct and non-negative.')
  return seeds


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.demo',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated, e.g. 0,1,2')
  parser.add_argument('--output-dir', default='runs/demo')
  parser.add_argument(
    '--objective',
    default='d1',
    help='the RL stage: d1 | espo | spg | wd1 | wd1pp | coupled_grpo (its '
    'own run directory rl_<objective>; pre-training and SFT are shared)',
  )
  parser.add_argument(
    '--route',
    default='rl',
    help="after SFT: rl (the task reward) | vrpo (SFT -> VRPO on the task's preference pairs) | "
    'reward (SFT -> a reward model on those pairs -> RL against it)',
  )
  parser.add_argument(
    '--pairs',
    default='other',
    help="the preference routes' rejected responses: other (another problem's solution) | "
    "near_miss (the problem's own solution with a plausible wrong final answer)",
  )
  parser.add_argument(
    '--task',
    default='arithmetic',
    help='arithmetic (where RL beats the '
    'noise), sudoku4, countdown3 or countdown4, each with its canvas '
    '(configs/demo.py, TASK_CANVAS)',
  )
  parser.add_argument(
    '--distill',
    default='',
    help='a fourth stage: distil the SFT model with this sft.objective (certainty | '
    'trajectory) and table teacher vs student per decoding setting',
  )
  parser.add_argument(
    '--keep',
    choices=distill_cli.KEEP,
    default='all',
    help="--distill's teacher rows: all, or only those the task judges correct (dParallel)",
  )
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    seeds = parse_seeds(args.seeds)
    if args.task not in tasks_lib.TASKS:
      raise ValueError(f'--task {args.task!r}: choose one of {sorted(tasks_lib.TASKS)}.')
    # refuses bad input
    routes.stage_configs(
      seeds[0], args.output_dir, args.task, args.objective, args.route, args.pairs
    )
    if args.distill:
      distill_objectives.get(args.distill)
    os.makedirs(args.output_dir, exist_ok=True)
    start, rows, distilled = time.time(), [], []
    for seed in seeds:
      rows += runs.run_seed(
        seed, args.output_dir, args.task, args.objective, route=args.route, pairs=args.pairs
      )
      if args.distill:
        distilled += distill_stage.run_distill(
          seed, args.output_dir, args.task, args.distill, keep=args.keep
        )
    summary = tables.aggregate(rows)
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  wall_s = time.time() - start
  table = tables.format_table(rows, summary)
  print(table)
  for seed in seeds if distilled else ():
    mine = [r for r in distilled if r['seed'] == seed]
    print(f'seed {seed}: distill ({args.distill}), {sets.EVAL_EXAMPLES} held-out problems')
    print(decoding_table.table(mine))
    print(decoding_table.verdict(mine))
  print(f'wall time {wall_s / 60:.1f} min for {len(seeds)} seed(s)')
  configs = {
    stage: os.path.relpath(routes.config_spec(stage, args.task, args.objective))
    for stage in routes.route_stages(args.route)
  }
  result = dict(
    task=args.task,
    objective=args.objective,
    route=args.route,
    pairs=args.pairs,
    seeds=seeds,
    configs=configs,
    eval_examples=sets.EVAL_EXAMPLES,
    wall_s=wall_s,
    rows=rows,
    summary=summary,
    table=table,
    distill=dict(objective=args.distill, rows=distilled) if args.distill else None,
  )
  tag = args.objective if args.route == 'rl' else f'{args.route}_{args.objective}'
  tag += routes.pairs_suffix(args.pairs) if args.route != 'rl' else ''
  name = 'results.json' if tag == 'd1' else f'results_{tag}.json'
  with open(os.path.join(args.output_dir, name), 'w') as f:
    json.dump(result, f, indent=2)
  return 0
