"""Verifiable tasks for RL and task accuracy: generated offline, split by solution, exact rewards.

TASKS maps a name to a Task: `examples(split, num, seed) -> list[Example]` and
`reward(example, completion) -> float` (never raises); `is_correct` gives held-out accuracy.
"""

from dlmjax.tasks.arithmetic import Arithmetic
from dlmjax.tasks.base import Example, Task, split_of
from dlmjax.tasks.countdown import Countdown
from dlmjax.tasks.gsm8k import Gsm8kJsonl
from dlmjax.tasks.sudoku import Sudoku4

TASKS: dict[str, Task] = {
  'countdown3': Countdown(3),
  'countdown4': Countdown(4),
  'sudoku4': Sudoku4(),
  'arithmetic': Arithmetic(),
}


def get_task(name: str, *, data_path: str = '') -> Task:
  """A task by name; 'gsm8k' reads user jsonl: data_path = 'TRAIN.jsonl[,TEST.jsonl]'."""
  if name == 'gsm8k':
    if not data_path:
      raise ValueError(
        'task gsm8k needs its jsonl: set --config.rl.task_data=TRAIN.jsonl[,TEST.jsonl].'
      )
    return Gsm8kJsonl(*data_path.split(',', 1))
  if name not in TASKS:
    raise ValueError(f'unknown task {name!r}; choose one of {sorted(TASKS) + ["gsm8k"]}.')
  return TASKS[name]


__all__ = [
  'TASKS',
  'Example',
  'Task',
  'get_task',
  'split_of',
  'Countdown',
  'Sudoku4',
  'Arithmetic',
  'Gsm8kJsonl',
]
