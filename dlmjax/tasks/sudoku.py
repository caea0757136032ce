"""4x4 Sudoku: fill the blanks ('0') of a grid with a unique solution (d1's reward, SPG's split).

All 288 valid grids are enumerated; puzzles blank 4..10 cells and keep a unique solution. The
split follows the solution grid, as SPG re-split d1's data, so no test grid is seen in training.
Reward: the share of originally blank cells filled correctly by the digits of the last <answer>,
padded/truncated to 16 (d1 reward_func.validate_sudoku_solution).

`sudoku` reads d1's data instead (dataset/4x4_sudoku_unique_puzzles.csv to train,
dataset/4x4_test_sudoku.csv to test: {"Puzzle": 16 digits, "Solution": 16 digits}) with d1's
prompt (diffu-grpo/data_utils.py and eval/sudoku.py agree on it) and the same reward.
"""

from __future__ import annotations

import functools
import re

from dlmjax.tasks import base
from dlmjax.tasks import gsm8k

_BOX = [[(r // 2) * 2 + c // 2 for c in range(4)] for r in range(4)]


@functools.cache
def all_grids() -> tuple[str, ...]:
  """The 288 solved 4x4 grids, as 16-character row-major strings (backtracking, in order)."""
  grids = []

  def fill(cells):
    if len(cells) == 16:
      grids.append(''.join(cells))
      return
    r, c = divmod(len(cells), 4)
    for d in '1234':
      clash = (
        d in cells[4 * r :]
        or any(cells[4 * k + c] == d for k in range(r))
        or any(cells[i] == d for i in range(len(cells)) if _BOX[i // 4][i % 4] == _BOX[r][c])
      )
      if not clash:
        fill(cells + [d])

  fill([])
  return tuple(grids)


def solutions(puzzle: str) -> list[str]:
  """Every grid consistent with a puzzle ('0' = blank)."""
  return [g for g in all_grids() if all(p in ('0', s) for p, s in zip(puzzle, g))]


def compute_score(completion: str, puzzle: str, solution: str) -> float:
  answer = base.last_answer(completion)
  if answer is None:
    return 0.0
  digits = ''.join(ch for ch in answer if ch.isdigit())[:16].ljust(16, '0')
  blanks = [i for i, ch in enumerate(puzzle) if ch == '0']
  if not blanks:
    return 0.0
  return sum(digits[i] == solution[i] for i in blanks) / len(blanks)


def _rows(grid: str) -> str:
  return ' '.join(grid[4 * r : 4 * r + 4] for r in range(4))


class Sudoku4(base.Task):
  name = 'sudoku4'
  max_reward = 1.0

  def __init__(self, *, min_blanks: int = 4, max_blanks: int = 10):
    self.min_blanks, self.max_blanks = min_blanks, max_blanks

  def _draw(self, rng):
    while True:
      solution = rng.choice(all_grids())
      blanks = rng.sample(range(16), rng.randint(self.min_blanks, self.max_blanks))
      puzzle = ''.join('0' if i in blanks else ch for i, ch in enumerate(solution))
      if len(solutions(puzzle)) == 1:
        break
    example = base.Example(
      prompt=f'Sudoku 4x4, 0 is blank: {_rows(puzzle)}',
      response=f'<answer>{_rows(solution)}</answer>',
      answer=solution,
    )
    return puzzle, solution, example

  def examples(self, split, num, seed):
    return base.collect(self.name, split, num, seed, self._draw)

  def near_miss(self, example, rng):
    """The solution with one blank cell's digit changed: a single slip in the grid."""
    cell = rng.choice([i for i, ch in enumerate(self._puzzle(example)) if ch == '0'])
    digit = rng.choice([d for d in '1234' if d != example.answer[cell]])
    grid = example.answer[:cell] + digit + example.answer[cell + 1 :]
    return f'<answer>{_rows(grid)}</answer>'

  @staticmethod
  def _puzzle(example) -> str:
    return ''.join(ch for ch in example.prompt.split(':', 1)[1] if ch.isdigit())

  def score(self, example, completion):
    return compute_score(completion, self._puzzle(example), example.answer)


D1_SYSTEM_PROMPT = """
Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string \
reading left-to-right, top-to-bottom, where '0' represents empty cells.

Rules:
- Fill empty cells with digits 1-4
- Each row must contain digits 1-4 exactly once
- Each column must contain digits 1-4 exactly once
- Each 2x2 box must contain digits 1-4 exactly once

Important: Your solution must be a COMPLETE 16-character string with only the digits 1-4, \
representing your final solved grid.

Respond in this exact format:
<reasoning>
Your step-by-step solving process
</reasoning>
<answer>
[16-character solution string with no spaces or separators]
</answer>
"""
# d1's eval extraction (eval/parse_and_get_acc.py, parse_sudoku_answers), first match wins.
_D1_EVAL_PATTERNS = (
  r'<answer>.*?```\s*([\d\s]+)```',
  r'<answer>(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|</answer>)',
  r'</answer>\s*(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|$)',
  r'.*?(\d{16})\s*</answer>',
  r'\b(\d{16})\b',
)


def _grid(value) -> str:
  """A 16-digit grid string; a CSV reader that took '0140...' for a number dropped its
  leading zeros."""
  text = str(value).strip()
  text = text.zfill(16) if text.isdigit() else text
  if len(text) != 16 or not text.isdigit():
    raise ValueError(f'{value!r} is not a 16-digit grid')
  return text


def d1_eval_cells(completion: str, puzzle: str, solution: str) -> float:
  """d1's sudoku evaluation of one completion: its patterns' first non-empty match, whitespace
  dropped (other characters kept), padded/truncated to 16; the share of blank cells right (d1
  reports the sum of right cells over the sum of blanks: the same per problem)."""
  answer = ''
  for pattern in _D1_EVAL_PATTERNS:
    match = re.search(pattern, completion, re.DOTALL)
    if match and match.group(1).strip():
      answer = match.group(1).strip()
      break
  answer = re.sub(r'\s', '', answer)
  blanks = [i for i, ch in enumerate(puzzle) if ch == '0']
  if not answer or not blanks:
    return 0.0
  answer = answer[:16].ljust(16, '0')
  return sum(answer[i] == solution[i] for i in blanks) / len(blanks)


class SudokuFile(base.FileTask):
  """d1's 4x4 sudoku data (one source per split), d1's prompt and reward."""

  name = 'sudoku'
  max_reward = 1.0
  row_help = '"Puzzle" and "Solution" (16-digit strings, 0 = blank)'

  def example_of(self, row):
    puzzle, solution = _grid(row['Puzzle']), _grid(row['Solution'])
    if any(p not in ('0', s) for p, s in zip(puzzle, solution)) or '0' in solution:
      raise ValueError('the solution does not fill the puzzle')
    return base.Example(
      prompt=f'{D1_SYSTEM_PROMPT}\n\nSolve the following Sudoku puzzle: {puzzle}\n',
      response=gsm8k.format_response('...', solution),
      answer=solution,
    )

  def score(self, example, completion):
    return compute_score(completion, self.puzzle_of(example), example.answer)

  @staticmethod
  def puzzle_of(example) -> str:
    return re.search(r'Sudoku puzzle: ([0-9]{16})', example.prompt).group(1)

  def peer_metrics(self, examples, completions):
    return {
      'd1_eval': [
        d1_eval_cells(c, self.puzzle_of(e), e.answer) for e, c in zip(examples, completions)
      ]
    }
