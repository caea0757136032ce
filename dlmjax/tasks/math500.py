"""MATH500-style problems from a data source, scored with d1's MATH rewards and a CAS checker.

Rows are {"problem", "solution"[, "answer"]} (HuggingFaceH4/MATH-500, ankner/math-500): the gold
answer is "answer" when present, else the last \\boxed{} of the solution (Hendrycks). d1's reward
(diffu-grpo/reward_func.py, MATH): correctness 2.0 (the completion's last box, equivalent to the
gold answer) + format 0.5 * (1.0 for <answer> tags + 1.0 if a \\boxed is inside them, else 0.5).
d1's own format check tests for '\\b'+'oxed' (a backspace escape), so its box bonus never fires;
this one tests for the box as intended (docs/evaluation.md, MATH).
"""

from __future__ import annotations

import re

from dlmjax.tasks import base
from dlmjax.tasks import gsm8k
from dlmjax.tasks import math_answer

INSTRUCTION = (
  'You are a math expert. You will be given a question to solve. Solve it step by step. '
  'Wrap the final answer in a \\boxed{}. '
)
MAX_REWARD = 3.0


def correctness_reward(completion: str, answer: str) -> float:
  """2.0 when the completion's final answer is equivalent to the gold one (d1: the last box)."""
  return 2.0 if math_answer.is_equiv(math_answer.extract_answer(completion), answer) else 0.0


def format_reward(completion: str) -> float:
  """d1's 0.5 * (1.0 for <answer> tags + box bonus of the tagged text, or of all without tags)."""
  tagged = '<answer>' in completion
  inside = completion.split('<answer>')[1].split('</answer>')[0] if tagged else completion
  return 0.5 * (float(tagged) + (1.0 if '\\boxed' in inside else 0.5))


def total_reward(completion: str, answer: str) -> float:
  return correctness_reward(completion, answer) + format_reward(completion)


class Math500(base.FileTask):
  """MATH-style data (one source per split): d1's prompt, rewards max 3.0."""

  name = 'math500'
  max_reward = MAX_REWARD
  row_help = '"problem" and "solution" (with a \\boxed answer) or "answer"'

  def example_of(self, row):
    problem, solution = row['problem'], row.get('solution') or ''
    answer = row.get('answer') or math_answer.last_boxed(solution)
    if not isinstance(problem, str) or not isinstance(answer, str) or not answer.strip():
      raise ValueError('no string "problem" or no answer (an "answer" or a \\boxed in "solution")')
    prompt = f'{gsm8k.SYSTEM_PROMPT}\n\n{INSTRUCTION}\n\n{problem}'
    response = gsm8k.format_response(solution.strip() or '...', f'\\boxed{{{answer.strip()}}}')
    return base.Example(prompt=prompt, response=response, answer=answer.strip())

  def score(self, example, completion):
    return total_reward(completion, example.answer)

  def is_correct(self, example, completion):
    return correctness_reward(completion, example.answer) > 0

  def peer_metrics(self, examples, completions):
    """d1's eval: the last box, else the <answer> text, equal after normalisation (no CAS);
    lm-eval minerva_math's math_verify: the CAS on the whole completion against the gold."""
    d1, verified = [], []
    for e, c in zip(examples, completions):
      answer = math_answer.last_boxed(c)
      if not answer:
        tags = re.search(r'<answer>(.*?)</answer>', c, re.DOTALL)
        answer = tags.group(1).strip() if tags else None
      d1.append(
        float(
          answer is not None and math_answer.normalize(answer) == math_answer.normalize(e.answer)
        )
      )
      verified.append(float(math_answer.cas_verify_text(c, e.answer)))
    return {'d1_eval': d1, 'lm_eval_math_verify': verified}
