"""Countdown: combine the given numbers, each once, with + - * / to reach a target (d1, TinyZero).

Every generated problem is solvable by construction (a random expression tree over the numbers);
the reward is d1's: 1.0 for a correct expression in the last <answer>, 0.1 for an answer that
uses the wrong numbers or value, 0 without one (dlm_peers.md 5).
"""

from __future__ import annotations

import ast
import fractions
import operator
import re

from dlmjax.tasks import base

CORRECT_SCORE = 1.0
FORMAT_SCORE = 0.1
_ALLOWED_RE = re.compile(r'^[\d+\-*/().\s]+$')  # d1's character whitelist
_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.FloorDiv: operator.floordiv,
}
_MAX_EXPONENT = 16  # '**' passes d1's whitelist; a huge power would hang eval, so we cap it.


def evaluate(expression: str) -> fractions.Fraction:
  """The exact value of an arithmetic expression over the characters d1 allows (eval's result
  without eval: ValueError on anything else, ZeroDivisionError on x/0)."""
  if not _ALLOWED_RE.match(expression):
    raise ValueError(f'characters outside digits, + - * / ( ) . in {expression!r}')

  def value(node):
    if isinstance(node, ast.Expression):
      return value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return fractions.Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
      v = value(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.FloorDiv):
        return fractions.Fraction(left // right)
      return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
      left, right = value(node.left), value(node.right)
      if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
        raise ValueError('exponent too large or fractional')
      return left ** int(right)
    raise ValueError(f'unsupported syntax {type(node).__name__}')

  return value(ast.parse(expression.strip(), mode='eval'))


def compute_score(completion: str, numbers: list[int], target: int) -> float:
  """d1's countdown reward (reward_func.compute_score) on the last <answer>...</answer>."""
  expression = base.last_answer(completion)
  if expression is None:
    return 0.0
  expression = expression.strip()
  if sorted(int(n) for n in re.findall(r'\d+', expression)) != sorted(numbers):
    return FORMAT_SCORE
  try:
    result = evaluate(expression)
  except (ValueError, ZeroDivisionError, SyntaxError, OverflowError, RecursionError):
    return FORMAT_SCORE
  return CORRECT_SCORE if abs(float(result) - target) < 1e-5 else FORMAT_SCORE


_PRECEDENCE = {'+': 1, '-': 1, '*': 2, '/': 2}


def _random_solution(rng, numbers):
  """A random expression tree over all numbers with positive integer intermediate values.

  Returns (expression, steps, value) or None when this draw hits a non-integer or non-positive
  intermediate."""
  pool = [(str(n), n, 3) for n in numbers]  # (text, value, precedence of its top operator)
  steps = []
  while len(pool) > 1:
    i, j = rng.sample(range(len(pool)), 2)
    (ta, va, pa), (tb, vb, pb) = pool[i], pool[j]
    op = rng.choice('+-*/')
    value = {
      '+': va + vb,
      '-': va - vb,
      '*': va * vb,
      '/': va // vb if vb and va % vb == 0 else None,
    }[op]
    if value is None or value <= 0:
      return None
    p = _PRECEDENCE[op]
    left = ta if pa >= p else f'({ta})'
    right = tb if pb > p or (pb == p and op in '+*') else f'({tb})'
    steps.append(f'{va}{op}{vb}={value}')
    pool = [x for k, x in enumerate(pool) if k not in (i, j)] + [(left + op + right, value, p)]
  return pool[0][0], steps, pool[0][1]


class Countdown(base.Task):
  """Countdown with `size` numbers in [1, max_number] and a target in [1, max_target]."""

  max_reward = CORRECT_SCORE

  def __init__(self, size: int, *, max_number: int = 30, max_target: int = 200):
    self.name = f'countdown{size}'
    self.size, self.max_number, self.max_target = size, max_number, max_target

  @staticmethod
  def prompt(numbers, target) -> str:
    return f'Use {", ".join(map(str, numbers))} to make {target} with + - * /.'

  def _draw(self, rng):
    while True:
      numbers = [rng.randint(1, self.max_number) for _ in range(self.size)]
      solution = _random_solution(rng, numbers)
      if solution is not None and solution[2] <= self.max_target:
        break
    expression, steps, target = solution
    response = f'{", ".join(steps)}\n<answer>{expression}</answer>'
    example = base.Example(
      prompt=self.prompt(numbers, target), response=response, answer=str(target)
    )
    # The answer is the target: splitting by it keeps every test target out of training.
    return (tuple(sorted(numbers)), target), str(target), example

  def examples(self, split, num, seed):
    return base.collect(self.name, split, num, seed, self._draw)

  def score(self, example, completion):
    numbers = [int(n) for n in re.findall(r'\d+', example.prompt.split(' to make ')[0])]
    return compute_score(completion, numbers, int(example.answer))
