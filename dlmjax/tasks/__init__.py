"""Verifiable tasks for RL and task accuracy: generated offline, split by solution, exact rewards.

TASKS maps a name to a Task: `examples(split, num, seed) -> list[Example]` and
`reward(example, completion) -> float` (never raises); `is_correct` gives held-out accuracy.
"""

from dlmjax.tasks.arithmetic import Arithmetic
from dlmjax.tasks.base import Example, Task, split_of
from dlmjax.tasks.code import HumanEval, HumanEvalInfill, KodCode, Mbpp
from dlmjax.tasks.countdown import Countdown, CountdownFile
from dlmjax.tasks.gsm8k import Gsm8kJsonl
from dlmjax.tasks.math500 import Math500
from dlmjax.tasks.sudoku import Sudoku4, SudokuFile

TASKS: dict[str, Task] = {
  'countdown3': Countdown(3),
  'countdown4': Countdown(4),
  'sudoku4': Sudoku4(),
  'arithmetic': Arithmetic(),
}


# Tasks read from a data source (jsonl, parquet, hub:NAME; dlmjax/data/records.py) per split.
FILE_TASKS: dict[str, type] = {
  'gsm8k': Gsm8kJsonl,
  'math500': Math500,
  'humaneval': HumanEval,
  'humaneval_infill': HumanEvalInfill,
  'mbpp': Mbpp,
  'kodcode': KodCode,
  'countdown': CountdownFile,
  'sudoku': SudokuFile,
}


def get_task(name: str, *, data_path: str = '', columns: str = '') -> Task:
  """A task by name; file tasks read data_path = 'TRAIN[,TEST]' (',TEST' for test only)."""
  if name in FILE_TASKS:
    if not data_path.strip(','):
      raise ValueError(
        f'task {name} needs its data: set --config.rl.task_data=TRAIN.jsonl[,TEST.jsonl] '
        '(parquet, json, arrow or hub:NAME[@SPLIT] too).'
      )
    return FILE_TASKS[name](*data_path.split(',', 1), columns=columns)
  if name not in TASKS:
    raise ValueError(f'unknown task {name!r}; choose one of {sorted(TASKS) + sorted(FILE_TASKS)}.')
  return TASKS[name]


__all__ = [
  'TASKS',
  'Example',
  'Task',
  'get_task',
  'split_of',
  'Countdown',
  'CountdownFile',
  'Sudoku4',
  'SudokuFile',
  'Arithmetic',
  'Gsm8kJsonl',
  'Math500',
  'FILE_TASKS',
  'HumanEval',
  'HumanEvalInfill',
  'Mbpp',
  'KodCode',
]
