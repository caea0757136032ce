"""Compares RL objectives on the tiny demo model: one pre-trained and fine-tuned model, then each
objective's RL stage once per RL seed, all with the same budget; held-out greedy reward of each.

  python -m benchmarks.rl_objectives --objectives d1,wd1,coupled_grpo --seeds 0,1,2 \
      [--task arithmetic] [--pretrain-steps 40] [--sft-steps 240] [--rl-steps 60] [--eval-num 128]
  python -m benchmarks.rl_objectives --objectives d1,wd1,wd1@train.lr=3e-5   # an lr of its own

An entry OBJECTIVE@KEY=VALUE[@KEY=VALUE...] runs that objective with those keys on top of its
recipe (one row per entry, named as written).

The stages are the demo's (configs/demo.py's recipe for --task, its per-objective overrides);
only the step counts change. Pre-training and SFT run once (seed 0), so the seeds vary only the
RL stage (its rollouts' prompts, samples and masks): the spread is RL's own, not the SFT models'
(dlmjax.demo varies both). Every RL run is scored on its final checkpoint with the demo's
held-out problems and greedy sampler. Prints one JSON row per run (prefixed RESULT), then one
table: per objective the held-out mean reward per seed, mean +- std and the gain over SFT, and
the process's CPU seconds (all threads) spent.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import time

import numpy as np

from dlmjax import config as config_lib
from dlmjax import demo
from dlmjax.train import loop


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--objectives', default='d1,wd1,coupled_grpo')
  parser.add_argument('--seeds', default='0,1,2', help='RL seeds')
  parser.add_argument('--task', default='arithmetic')
  parser.add_argument('--pretrain-steps', type=int, default=40)
  parser.add_argument('--sft-steps', type=int, default=240)
  parser.add_argument('--rl-steps', type=int, default=60)
  parser.add_argument('--eval-num', type=int, default=demo.EVAL_EXAMPLES)
  parser.add_argument('--work-dir', default='runs/rl_objectives')
  args = parser.parse_args()
  objectives = args.objectives.split(',')
  seeds = [int(s) for s in args.seeds.split(',')]
  start = time.time()

  base = demo.stage_configs(0, args.work_dir, args.task)
  for stage, steps in (('pretrain', args.pretrain_steps), ('sft', args.sft_steps)):
    config_lib.apply_overrides(
      base[stage], {'train.steps': steps, 'train.wsd_decay_steps': max(1, steps // 10)}
    )
  sampling = demo.eval_sampling(base['rl'])
  demo.write_sft_set(base['sft'].sft.train_file, args.task)
  loop.train(base['pretrain'])
  loop.train(base['sft'])
  sft = demo.evaluate_stage(base['sft'].output_dir, args.task, sampling=sampling, num=args.eval_num)
  print('RESULT', json.dumps(dict(stage='sft', mean_reward=sft['mean_reward'])), flush=True)

  rewards = {}
  for entry in objectives:
    objective, *keys = entry.split('@')
    name = re.sub(r'[^A-Za-z0-9.-]+', '_', entry)
    for seed in seeds:
      config = copy.deepcopy(demo.stage_configs(0, args.work_dir, args.task, objective)['rl'])
      config_lib.apply_overrides(config, keys)
      config_lib.apply_overrides(
        config,
        {
          'seed': seed,
          'output_dir': os.path.join(args.work_dir, f'rl_{name}_seed{seed}'),
          'train.steps': args.rl_steps,
          'train.warmup_steps': min(config.train.warmup_steps, args.rl_steps // 2),
          'eval.every': 0,  # scored once, on the final checkpoint
          'checkpoint.every': args.rl_steps,
          'checkpoint.keep': 1,
        },
      )
      loop.train(config)
      score = demo.evaluate_stage(
        config.output_dir, args.task, sampling=sampling, num=args.eval_num
      )
      rewards.setdefault(entry, []).append(score['mean_reward'])
      row = dict(objective=entry, seed=seed, mean_reward=score['mean_reward'])
      print('RESULT', json.dumps(row), flush=True)

  print(
    f'\n{args.task}: pre-train {args.pretrain_steps} + SFT {args.sft_steps} steps (once, seed 0),'
    f' then RL {args.rl_steps} steps per objective and seed; held-out greedy mean reward on '
    f'{args.eval_num} test problems; SFT model {sft["mean_reward"]:.3f}'
  )
  print('| objective | ' + ' | '.join(f'seed {s}' for s in seeds) + ' | mean +- std | gain |')
  print('|---|' + '---:|' * (len(seeds) + 2))
  for objective, values in rewards.items():
    v = np.asarray(values)
    print(
      f'| {objective} | '
      + ' | '.join(f'{x:.3f}' for x in v)
      + f' | {v.mean():.3f} +- {v.std():.3f} | {v.mean() - sft["mean_reward"]:+.3f} |'
    )
  print(f'wall {time.time() - start:.0f} s, CPU {cpu_seconds():.0f} s (all threads)')


if __name__ == '__main__':
  main()
