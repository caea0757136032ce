"""Checks that RL moves a fine-tuned demo model the right way, on a reward it can follow.

  python scripts/research/rl_direction_check.py --from runs/demo/seed1 --reward ones-share
  python scripts/research/rl_direction_check.py --from runs/demo/seed1 --fixed-batch \
      --overrides '{"rl.inner_updates": 20, "train.steps": 60, "train.lr": 1e-5, "rl.kl_beta": 0}'

Runs the demo's RL stage (configs/demo.py's recipe, seed of --seed) from FROM/sft and prints the
rollout mean reward per rollout and the logged KL. Two probes, for when held-out reward does not
move (docs/benchmarks.md, "RL recipe search"):
  --reward ones-share  the sudoku4 reward becomes the share of '1' digits in the answer: a
                       preference SFT never taught, so a working RL loop must raise it.
  --fixed-batch        every rollout reuses rollout 0's prompts and sampling key, so each
                       rollout reward is the same batch's reward after the updates on it.
Both patch the task / rollout source in this process only.
"""

from __future__ import annotations

import argparse
import json
import os

from dlmjax import config as config_lib
from dlmjax import demo, tasks
from dlmjax.rl import rollout
from dlmjax.tasks import base
from dlmjax.train import loop


def ones_share(_, example, completion) -> float:
  del example
  digits = ''.join(ch for ch in (base.last_answer(completion) or '') if ch.isdigit())
  return digits.count('1') / max(len(digits), 1)


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--from', dest='source', required=True, help='a demo seed directory')
  parser.add_argument('--seed', type=int, default=1)
  parser.add_argument('--output-dir', default='runs/rl_direction_check')
  parser.add_argument('--reward', choices=('task', 'ones-share'), default='task')
  parser.add_argument('--fixed-batch', action='store_true')
  parser.add_argument('--overrides', default='{}', help='JSON {dotted key: value} for RL')
  args = parser.parse_args()
  if args.reward == 'ones-share':
    type(tasks.TASKS['sudoku4']).score = ones_share
  if args.fixed_batch:
    make_rollout = rollout.RolloutBatches._rollout
    rollout.RolloutBatches._rollout = lambda self, index, params: make_rollout(self, 0, params)
  config = demo.stage_configs(args.seed, args.source, 'sudoku4')['rl']
  config.output_dir = args.output_dir
  config.checkpoint.every = 0
  config_lib.apply_overrides(config, json.loads(args.overrides))
  loop.train(config)
  with open(os.path.join(config.output_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  print('rollout reward:', [round(r['rollout_reward_mean'], 3) for r in rows if 'rollout' in r])
  print('kl:', [round(r['kl'], 4) for r in rows if 'kl' in r])


if __name__ == '__main__':
  main()
