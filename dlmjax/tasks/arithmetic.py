"""Multi-digit arithmetic word-free problems scored with d1's GSM8K reward set (max 4.0).

A synthetic stand-in for GSM8K that runs offline: the same <reasoning>/<answer> format and the
same five additive rewards (gsm8k.py), a non-negative integer answer, and a split by answer value.
"""

from __future__ import annotations

from dlmjax.tasks import base, gsm8k


class Arithmetic(base.Task):
  """a op b [op c] with two-digit operands (+, -, *), evaluated with the usual precedence."""

  name = 'arithmetic'
  max_reward = gsm8k.MAX_REWARD

  def __init__(self, *, max_operand: int = 99, max_terms: int = 3):
    self.max_operand, self.max_terms = max_operand, max_terms

  def _draw(self, rng):
    while True:
      n = rng.randint(2, self.max_terms)
      values = [rng.randint(2, self.max_operand) for _ in range(n)]
      ops = [rng.choice('+-*') for _ in range(n - 1)]
      steps, answer = _solve(values, ops)
      if answer >= 0:
        break
    expression = ''.join(f'{v}{o}' for v, o in zip(values, ops)) + str(values[-1])
    response = gsm8k.format_response(', '.join(steps), str(answer))
    example = base.Example(prompt=f'Compute {expression}.', response=response, answer=str(answer))
    return expression, str(answer), example

  def examples(self, split, num, seed):
    return base.collect(self.name, split, num, seed, self._draw)

  def near_miss(self, example, rng):
    """The last step's result and the answer, both off by a slip (1, 2 or 10 either way), so
    the response stays self-consistent and only checking the arithmetic tells it is wrong."""
    reasoning = example.response.split('<reasoning>\n', 1)[1].split('\n</reasoning>', 1)[0]
    head = reasoning.rpartition('=')[0]  # the steps end in '=ANSWER'
    answer = int(example.answer)
    slips = [answer + d for d in (-10, -2, -1, 1, 2, 10) if answer + d >= 0]
    wrong = str(rng.choice(slips))
    return gsm8k.format_response(f'{head}={wrong}', wrong)

  def score(self, example, completion):
    return gsm8k.total_reward(completion, example.answer)

  def is_correct(self, example, completion):
    """The exact-answer reward alone (format rewards aside), as GSM8K accuracy."""
    return gsm8k.correctness_reward(completion, example.answer) > 0


def _solve(values, ops):
  """Steps 'a*b=c' in evaluation order (products first, then left to right) and the result."""
  values, ops, steps = list(values), list(ops), []
  while '*' in ops:
    i = ops.index('*')
    result = values[i] * values[i + 1]
    steps.append(f'{values[i]}*{values[i + 1]}={result}')
    values[i : i + 2], ops[i : i + 1] = [result], []
  while ops:
    result = values[0] + values[1] if ops[0] == '+' else values[0] - values[1]
    steps.append(f'{values[0]}{ops[0]}{values[1]}={result}')
    values[0:2], ops[0:1] = [result], []
  return steps, values[0]
