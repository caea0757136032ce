"""4x4 Sudoku: fill the blanks ('0') of a grid with a unique solution (d1's reward, SPG's split).

All 288 valid grids are enumerated; puzzles blank 4..10 cells and keep a unique solution. The
split follows the solution grid, as SPG re-split d1's data, so no test grid is seen in training.
Reward: the share of originally blank cells filled correctly by the digits of the last <answer>,
padded/truncated to 16 (d1 reward_func.validate_sudoku_solution).
"""

from __future__ import annotations

import functools

from dlmjax.tasks import base

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

  def score(self, example, completion):
    puzzle = ''.join(ch for ch in example.prompt.split(':', 1)[1] if ch.isdigit())
    return compute_score(completion, puzzle, example.answer)
