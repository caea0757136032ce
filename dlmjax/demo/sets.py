"""The demo's data sets, written from a task's problems: the SFT rows and the preference pairs
from its train split, the pairs' held-out ones from its test split."""

from __future__ import annotations

import os

from dlmjax import tasks as tasks_lib
from dlmjax.data import jsonl
from dlmjax.demo import routes
from dlmjax.train import preference_rows

SFT_EXAMPLES = 4000  # task training examples written as the SFT set (worked solutions)
EVAL_EXAMPLES = 128  # held-out problems per stage and seed (the same ones for every stage)


def write_pair_sets(
  run_dir: str, task: str, num: int = SFT_EXAMPLES, seed: int = 0, pairs: str = 'other'
) -> None:
  """The task's preference pairs of kind `pairs`: from its train split for training, its test
  split held out."""
  files = routes.pair_files(run_dir, task, pairs)
  for path, split, count in zip(files, ('train', 'test'), (num, EVAL_EXAMPLES)):
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    jsonl.write_objects(path, preference_rows.task_pairs(task, split, count, seed, pairs))


def write_sft_set(path: str, task: str, num: int = SFT_EXAMPLES, seed: int = 0) -> str:
  """Worked solutions of the task's TRAIN split as SFT rows (the held-out split never enters)."""
  examples = tasks_lib.get_task(task).examples('train', num, seed)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  return jsonl.write_objects(path, [{'prompt': e.prompt, 'response': e.response} for e in examples])
