"""Countdown: combine the given numbers, each once, with + - * / to reach a target (d1, TinyZero).

Every generated problem (countdown3, countdown4) is solvable by construction (a random expression
tree over the numbers) and has a short prompt for small models. `countdown` reads d1's data
instead: Jiayi-Pan/Countdown-Tasks-3to4 rows {"nums": [..], "target": N} (d1 trains on those
with 3 numbers) or d1's test file dataset/countdown_cd3_test.jsonl {"input": "30,100,93",
"output": "23"}, with d1's RL prompt (diffu-grpo/data_utils.py, get_countdown_questions).
The reward is d1's for both (diffu-grpo/reward_func.py, compute_score): 1.0 for a correct
expression in the last <answer>, 0.1 for an answer that uses the wrong numbers or value, 0
without one (dlm_peers.md 5).
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import operator
import re

from dlmjax.tasks import base
from dlmjax.tasks import gsm8k

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

  def near_miss(self, example, rng, *, draws: int = 32):
    """A worked solution over the same numbers that misses the target by the least of `draws`
    random expression trees: self-consistent steps, only the value is wrong."""
    numbers, target = self._numbers(example), int(example.answer)
    misses = []
    for _ in range(50 * draws):  # most trees are valid; the cap only guards a degenerate set
      solution = _random_solution(rng, numbers)
      if solution is not None and solution[2] != target:
        misses.append(solution)
      if len(misses) == draws:
        break
    if not misses:
      raise ValueError(f'{self.name}: no expression over {numbers} misses {target}.')
    expression, steps, _ = min(misses, key=lambda s: abs(s[2] - target))
    return f'{", ".join(steps)}\n<answer>{expression}</answer>'

  @staticmethod
  def _numbers(example) -> list[int]:
    return [int(n) for n in re.findall(r'\d+', example.prompt.split(' to make ')[0])]

  def score(self, example, completion):
    return compute_score(completion, self._numbers(example), int(example.answer))


# d1's RL prompt: its system prompt (gsm8k.SYSTEM_PROMPT between newlines), then the task.
D1_PROMPT = (
  '\n' + gsm8k.SYSTEM_PROMPT + '\n\nUsing only the numbers {numbers}, create an arithmetic '
  'expression that evaluates to exactly {target}. You must use all numbers from the list, and '
  'each number must be used exactly once. You may use the operations +, -, *, and / as needed. '
  'After reasoning, provide only your final expression inside <answer></answer> tags without '
  'including an equals sign or the target number. For example, if the numbers are [2, 3, 4] and '
  'the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>'
)


@dataclasses.dataclass(frozen=True)
class CountdownExample(base.Example):
  """An Example with its numbers; `answer` is the target."""

  numbers: tuple[int, ...] = ()


def _d1_eval_equation(completion: str) -> str:
  """The text d1's countdown evaluation scores (eval/parse_and_get_acc.py with its
  parser_helper): after the last '\\boxed ' to a '$'; else the last \\boxed{...} (\\fbox{...}
  kept whole); without a box, the WHOLE completion (its <answer> fallback runs only for an
  unclosed box, where its helper raises)."""
  if '\\boxed ' in completion:
    return completion.split('\\boxed ')[-1].split('$')[0]
  start = completion.rfind('\\boxed')
  start = start if start >= 0 else completion.rfind('\\fbox')
  if start < 0:
    return completion
  depth = 0
  for i in range(start, len(completion)):
    depth += {'{': 1, '}': -1}.get(completion[i], 0)
    if completion[i] == '}' and depth == 0:
      boxed = completion[start : i + 1]
      return boxed[len('\\boxed{') : -1] if boxed.startswith('\\boxed{') else boxed
  match = re.search(r'<answer>(.*?)</answer>', completion, re.DOTALL)
  return match.group(1).strip() if match else completion


def d1_eval_correct(completion: str, numbers, target: int) -> bool:
  """d1's countdown evaluation (parse_countdown_answers) of one completion: its equation
  (_d1_eval_equation) with LaTeX \\div \\times \\cdot read as / * *, an 'expression = value'
  cut to the expression; correct when it uses exactly the numbers and its value is within 1e-5
  of the target. d1's eval prompt asks for the expression in a \\boxed{}: an unboxed
  completion is correct only when it is the bare expression."""
  equation = _d1_eval_equation(completion)
  equation = equation.replace('\\div', '/').replace('\\times', '*').replace('\\cdot', '*')
  match = re.search(r'([0-9+\-*/() ]+)=[0-9. ]+', equation)
  if match:
    equation = match.group(1).strip()
  if sorted(int(n) for n in re.findall(r'\d+', equation)) != sorted(numbers):
    return False
  try:
    return abs(float(evaluate(equation)) - target) < 1e-5
  except (ValueError, ZeroDivisionError, SyntaxError, OverflowError, RecursionError):
    return False


class CountdownFile(base.FileTask):
  """d1's countdown data (one source per split), d1's prompt and reward."""

  name = 'countdown'
  max_reward = CORRECT_SCORE
  row_help = '"nums" (a list) and "target", or d1\'s "input" ("30,100,93") and "output"'

  def example_of(self, row):
    if 'nums' in row:
      numbers, target = row['nums'], row['target']
    else:
      numbers, target = str(row['input']).split(','), row['output']
    numbers, target = [int(n) for n in numbers], int(target)
    if not numbers:
      raise ValueError('no numbers')
    return CountdownExample(
      prompt=D1_PROMPT.format(numbers=numbers, target=target),
      response='',  # d1's data holds no solution: these rows are for RL and evaluation
      answer=str(target),
      numbers=tuple(numbers),
    )

  def score(self, example, completion):
    return compute_score(completion, list(example.numbers), int(example.answer))

  def peer_metrics(self, examples, completions):
    return {
      'd1_eval': [
        float(d1_eval_correct(c, e.numbers, int(e.answer))) for e, c in zip(examples, completions)
      ]
    }
