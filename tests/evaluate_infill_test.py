"""Infilling evaluation of a code task: HumanEval-Infilling rows (openai/human-eval-infilling's
format: prompt, suffix, canonical_solution, test, entry_point), the hole filled by the infilling
sampler, the program prompt + middle + suffix run in the code sandbox for pass@1."""

import json

import pytest

from dlmjax import evaluate
from dlmjax import lm_eval_adapter
from dlmjax import tasks
from dlmjax.rl import prompts
from dlmjax.tasks import code

# A single-line hole and a multi-line one; without the suffix neither function returns a value,
# without the prefix neither is defined: only prompt + middle + suffix passes.
ROWS = [
  dict(
    task_id='SingleLineInfilling/T/0/L1',
    prompt='def add(a, b):\n    total = 0\n',
    suffix='    return total\n',
    canonical_solution='    total = a + b\n',
    test='def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 1) == 1',
    entry_point='add',
  ),
  dict(
    task_id='MultiLineInfilling/T/1/L1_L2',
    prompt='def evens(xs):\n    out = []\n',
    suffix='    return out\n',
    canonical_solution='    for x in xs:\n        if x % 2 == 0:\n            out.append(x)\n',
    test='def check(candidate):\n    assert candidate([1, 2, 4]) == [2, 4]\n',
    entry_point='evens',
  ),
]


def _rows_file(tmp_path):
  path = tmp_path / 'humaneval_infill.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in ROWS))
  return str(path)


def test_holes_are_filled_and_run_with_prefix_and_suffix(tmp_path):
  class Filler:  # the first hole filled right, the second with a wrong middle
    def generate(self, prompts):
      raise AssertionError('an infilling task must not be decoded as a continuation')

    def infill(self, examples, hole_tokens):
      assert hole_tokens == 0 and [e.suffix for e in examples] == [r['suffix'] for r in ROWS]
      by_id = {r['task_id']: r for r in ROWS}
      first = by_id[examples[0].answer]['canonical_solution']
      return [first, '    out = xs\n' if 'evens' in examples[1].prefix else '    pass\n']

  results, summary = evaluate.tasks_mode(
    Filler(), [('humaneval_infill', _rows_file(tmp_path))], num=0, seed=0
  )
  assert summary['humaneval_infill']['examples'] == 2
  assert summary['humaneval_infill']['accuracy'] == 0.5  # pass@1
  right = next(r for r in results if r['correct'])
  assert right['completion'] in (ROWS[0]['canonical_solution'], ROWS[1]['canonical_solution'])
  task = tasks.get_task('humaneval_infill', data_path=f',{_rows_file(tmp_path)}')
  for e in task.examples('test', 0, seed=0):
    assert task.reward(e, e.response) == 1.0  # the canonical middle passes every test
    program = code.program_of(e, e.response)
    assert program.solution == e.prefix + e.response + e.suffix
  with pytest.raises(ValueError, match='hole-tokens -1'):
    evaluate.tasks_mode(
      Filler(), [('humaneval_infill', _rows_file(tmp_path))], num=0, seed=0, hole_tokens=-1
    )
  with pytest.raises(ValueError, match='fills holes'):  # RL samples continuations only
    prompts.Prompts(None, task, None)
  with pytest.raises(ValueError, match='cannot fill a hole'):
    lm_eval_adapter.write_local_tasks([('humaneval_infill', _rows_file(tmp_path))], str(tmp_path))
