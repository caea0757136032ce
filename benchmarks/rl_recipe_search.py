"""Searches RL recipes for the three-stage demo: pre-train -> SFT -> several RL variants per seed.

  python -m benchmarks.rl_recipe_search --seeds 0,1 --sft-steps 500 \
      --variants '{"d1_3e-5": {"train.steps": 800, "train.lr": 3e-5, "checkpoint.every": 200}}'

Each seed pre-trains and fine-tunes once per --sft-steps value (the demo's recipe,
configs/demo.py, for --task, with the SFT length replaced), then runs every RL variant (dotted
overrides of the demo's RL config) from that SFT model. Every RL checkpoint is scored greedily on
the demo's 128 held-out problems. One JSON row per SFT model and per variant goes to stdout
(prefixed RESULT) and to --out: held-out (mean reward, accuracy) of the SFT model and of each RL
checkpoint, and the training rollouts' mean reward per rollout. Sized for a GPU
(docs/benchmarks.md, "RL recipe search"); on the CPU each variant takes minutes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import time

from dlmjax import config as config_lib
from dlmjax import demo
from dlmjax.train import loop


def held_out(
  path: str,
  task: str,
  sampling,
  steps: int | None = None,
  temperature: float = 0.0,
  samples: int = 1,
) -> list[float]:
  """[mean reward, accuracy] greedily with the task's demo sampler (the RL variant's diffusion
  steps if it sets them); with temperature > 0 also the mean reward of `samples` sampled
  completions per problem."""
  if steps:
    sampling = dataclasses.replace(sampling, steps=steps)
  scores = demo.evaluate_stage(path, task, sampling=sampling)
  row = [round(scores['mean_reward'], 4), round(scores['accuracy'], 4)]
  if temperature > 0:
    sampled = demo.evaluate_stage(
      path, task, sampling=dataclasses.replace(sampling, temperature=temperature), samples=samples
    )
    row.append(round(sampled['mean_reward'], 4))
  return row


def rollout_rewards(run_dir: str) -> list[float]:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [round(r['rollout_reward_mean'], 3) for r in rows if 'rollout' in r]


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--sft-steps', default='240', help='comma-separated SFT lengths')
  parser.add_argument('--variants', required=True, help='JSON {name: {dotted key: value}}')
  parser.add_argument('--task', default='sudoku4')
  parser.add_argument('--work-dir', default='runs/rl_search')
  parser.add_argument('--out', default='runs/rl_search/results.json')
  parser.add_argument('--budget-s', type=float, default=0, help='stop starting variants after')
  parser.add_argument(
    '--eval-temperature',
    type=float,
    default=0.0,
    help='also score sampled completions at this temperature',
  )
  parser.add_argument(
    '--eval-samples',
    type=int,
    default=1,
    help='sampled completions per held-out problem (with --eval-temperature)',
  )
  args = parser.parse_args()
  variants = json.loads(args.variants)
  start, results = time.time(), []
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

  def record(row):
    print('RESULT', json.dumps(row), flush=True)
    results.append(row)
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=1)

  for seed in [int(s) for s in args.seeds.split(',')]:
    for sft_steps in [int(s) for s in args.sft_steps.split(',')]:
      run_dir = os.path.join(args.work_dir, f'seed{seed}_sft{sft_steps}')
      configs = demo.stage_configs(seed, run_dir, args.task)
      config_lib.apply_overrides(
        configs['sft'], {'train.steps': sft_steps, 'train.wsd_decay_steps': max(1, sft_steps // 10)}
      )
      sampling = demo.eval_sampling(configs['rl'])
      demo.write_sft_set(configs['sft'].sft.train_file, args.task)
      loop.train(configs['pretrain'])
      loop.train(configs['sft'])
      sft = held_out(
        configs['sft'].output_dir,
        args.task,
        sampling,
        temperature=args.eval_temperature,
        samples=args.eval_samples,
      )
      record(dict(seed=seed, sft_steps=sft_steps, sft=sft))
      for name, overrides in variants.items():
        if args.budget_s and time.time() - start > args.budget_s:
          print('budget spent; variants left out', flush=True)
          return
        config = copy.deepcopy(configs['rl'])
        config.output_dir = os.path.join(run_dir, f'rl_{name}')
        config_lib.apply_overrides(config, overrides)
        variant_start = time.time()
        eval_steps = overrides.get('sampler.steps')  # scored with the sampler it trained
        loop.train(config)
        checkpoints = os.path.join(config.output_dir, 'checkpoints')
        steps = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
        record(
          dict(
            seed=seed,
            sft_steps=sft_steps,
            variant=name,
            sft=sft,
            sft_at_variant_steps=sft
            if eval_steps is None
            else held_out(
              configs['sft'].output_dir,
              args.task,
              sampling,
              eval_steps,
              args.eval_temperature,
              args.eval_samples,
            ),
            rl={
              s: held_out(
                os.path.join(checkpoints, str(s)),
                args.task,
                sampling,
                eval_steps,
                args.eval_temperature,
                args.eval_samples,
              )
              for s in steps
            },
            rollout_rewards=rollout_rewards(config.output_dir),
            rl_s=round(time.time() - variant_start),
          )
        )


if __name__ == '__main__':
  main()
