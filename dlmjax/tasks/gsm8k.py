"""d1's GSM8K reward set, and a loader for GSM8K-style jsonl that users bring.

The five additive rewards of d1 (diffu-grpo/reward_func.py, from the open GRPO demo), max 4.0:
xml tag count (<= 0.5), soft format 0.5, strict format 0.5, integer answer 0.5, exact answer 2.0.
Both format patterns match from the start of the completion, across lines (re.DOTALL), as d1.
"""

from __future__ import annotations

import re

from dlmjax.tasks import base

SYSTEM_PROMPT = (
  'Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>'
)
MAX_REWARD = 4.0
_STRICT = r'^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$'
_SOFT = r'<reasoning>.*?</reasoning>\s*<answer>.*?</answer>'


def format_response(reasoning: str, answer: str) -> str:
  """The completion d1's format rewards expect (all five rewards fire on it)."""
  return f'<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>\n'


def extract_xml_answer(text: str) -> str:
  return text.split('<answer>')[-1].split('</answer>')[0].strip()


def correctness_reward(completion: str, answer: str) -> float:
  return 2.0 if extract_xml_answer(completion) == answer else 0.0


def int_reward(completion: str) -> float:
  return 0.5 if extract_xml_answer(completion).isdigit() else 0.0


def strict_format_reward(completion: str) -> float:
  return 0.5 if re.match(_STRICT, completion, flags=re.DOTALL) else 0.0


def soft_format_reward(completion: str) -> float:
  return 0.5 if re.match(_SOFT, completion, flags=re.DOTALL) else 0.0


def xml_count_reward(text: str) -> float:
  count = 0.0
  if text.count('<reasoning>\n') == 1:
    count += 0.125
  if text.count('\n</reasoning>\n') == 1:
    count += 0.125
  if text.count('\n<answer>\n') == 1:
    count += 0.125
    count -= len(text.split('\n</answer>\n')[-1]) * 0.001
  if text.count('\n</answer>') == 1:
    count += 0.125
    count -= (len(text.split('\n</answer>')[-1]) - 1) * 0.001
  return count


def total_reward(completion: str, answer: str) -> float:
  return (
    xml_count_reward(completion)
    + soft_format_reward(completion)
    + strict_format_reward(completion)
    + int_reward(completion)
    + correctness_reward(completion, answer)
  )


_NUMBER = r'-?\d+\.?\d*'
_FLEXIBLE = re.compile(r'(-?[$0-9.,]{2,})|(-?[0-9]+)')


def d1_eval_answer(text: str) -> float | None:
  """d1's eval (eval/parse_and_get_acc.py, GSM8K): the first \\boxed{} with a number (itself,
  or its first number), else the <answer> tags' number (itself, or their last number)."""
  for content in re.findall(r'\\boxed{(.*?)}', text):
    content = content.strip()
    if not content or re.fullmatch(r'\.+', content):
      continue
    value = _float(content) if _float(content) is not None else _first(re.findall(_NUMBER, content))
    if value is not None:
      return value
  match = re.search(r'<answer>(.*?)</answer>', text, re.DOTALL)
  if match and match.group(1).strip():
    inner = match.group(1).strip()
    return _float(inner) if _float(inner) is not None else _first(re.findall(_NUMBER, inner)[-1:])
  return None


def _float(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


def _first(numbers: list[str]) -> float | None:
  return _float(numbers[0]) if numbers else None


def flexible_extract(text: str) -> str:
  """lm-eval gsm8k's flexible-extract: the last number-like match, with its exact_match's
  regexes_to_ignore (',', '$', a trailing '.') applied."""
  matches = _FLEXIBLE.findall(text)
  if not matches:
    return ''
  found = next(group for group in matches[-1] if group)
  return re.sub(r'\.$', '', found.replace(',', '').replace('$', '')).strip()


def final_answer(solution: str) -> str:
  """GSM8K's answer field ends in '#### 42'; the number after it, without thousands commas."""
  if '####' not in solution:
    raise ValueError('no "#### <answer>" line')
  return solution.split('####')[-1].strip().replace(',', '')


def load_jsonl(path: str, *, columns: str = '') -> list[base.Example]:
  """Examples from GSM8K-style rows ({"question": ..., "answer": "... #### 42"})."""
  return Gsm8kJsonl(path, columns=columns).load(path)


def gsm8k_example(question: str, solution: str, system_prompt: str = SYSTEM_PROMPT) -> base.Example:
  answer = final_answer(solution)
  reasoning = solution.split('####')[0].strip()
  prompt = f'{system_prompt}\n\n{question}' if system_prompt else question
  return base.Example(prompt=prompt, response=format_response(reasoning, answer), answer=answer)


class Gsm8kJsonl(base.FileTask):
  """GSM8K-style data (one source per split), scored with d1's five rewards."""

  name = 'gsm8k'
  max_reward = MAX_REWARD
  row_help = '"question" and "answer" ending in "#### <answer>"'

  def example_of(self, row):
    question, solution = row['question'], row['answer']
    if not isinstance(question, str) or not isinstance(solution, str):
      raise TypeError('"question" and "answer" must be strings')
    return gsm8k_example(question, solution)

  def score(self, example, completion):
    return total_reward(completion, example.answer)

  def is_correct(self, example, completion):
    return correctness_reward(completion, example.answer) > 0

  def peer_metrics(self, examples, completions):
    d1, flexible = [], []
    for e, c in zip(examples, completions):
      value = d1_eval_answer(c)
      d1.append(float(value is not None and value == _float(e.answer)))
      flexible.append(float(flexible_extract(c) == e.answer))
    return {'d1_eval': d1, 'lm_eval_flexible': flexible}
