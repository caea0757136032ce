"""Preference pairs: the three layouts, the shared-prompt rule, the too-long switch, the built-in
pairs."""

import json
import re

import numpy as np
import pytest

from dlmjax import tasks
from dlmjax.data import chat

from dlmjax.data.errors import DataError
from dlmjax.train import preference_rows, sft_rows
from tests.data.sft_test import EOS, CharTokenizer, write_jsonl

USER = [{'role': 'user', 'content': 'Compute 1+1.'}]


def _reply(text):
  return [{'role': 'assistant', 'content': text}]


def test_every_layout_gives_the_same_pair(tmp_path):
  """Strings, UltraFeedback's whole conversations and TRL's conversational prompt all read as
  (the prompt rendered with the template, chosen text, rejected text); data.columns renames."""
  path = write_jsonl(
    tmp_path / 'pairs.jsonl',
    [
      {'prompt': 'Compute 1+1.', 'chosen': '2', 'rejected': '3'},
      {'chosen': USER + _reply('2'), 'rejected': USER + _reply('3')},
      {'prompt': USER, 'chosen': _reply('2'), 'rejected': _reply('3')},
      {'prompt': 'Compute 1+1.', 'chosen': _reply('2'), 'rejected': _reply('3')},
    ],
  )
  pairs = preference_rows.read_pairs(path, 'plain')
  want = (chat.prompt_text('plain', 'Compute 1+1.'), '2', '3')
  assert [p[1:] for p in pairs] == [want] * 4
  renamed = write_jsonl(tmp_path / 'r.jsonl', [{'q': 'Compute 1+1.', 'good': '2', 'bad': '3'}])
  got = preference_rows.read_pairs(renamed, 'plain', 'prompt=q,chosen=good,rejected=bad')
  assert got[0][1:] == want


@pytest.mark.parametrize(
  'row, message',
  [
    ({'prompt': 'p', 'chosen': 'a'}, 'rows need "chosen" and "rejected"'),
    ({'chosen': 'a', 'rejected': 'b'}, 'need a string "prompt"'),
    (
      {'chosen': USER + _reply('2'), 'rejected': [{'role': 'user', 'content': 'x'}] + _reply('3')},
      'continue different conversations',
    ),
    ({'prompt': 'p', 'chosen': ' ', 'rejected': 'b'}, 'empty chosen or rejected'),
  ],
)
def test_bad_rows_name_the_row(tmp_path, row, message):
  path = write_jsonl(tmp_path / 'bad.jsonl', [row])
  with pytest.raises(DataError, match=f'bad.jsonl:1: .*{message}'):
    preference_rows.read_pairs(path, 'plain')


def test_pair_rows_keep_both_sides_together_under_the_too_long_switch():
  pairs = [('f:1', 'ab', 'cd', 'e'), ('f:2', 'ab', 'c', 'efghijk'), ('f:3', 'abcdefgh', 'x', 'y')]
  kwargs = dict(eos_id=EOS, canvas=8, log=lambda line: None)
  rows = preference_rows.pair_rows(pairs, CharTokenizer(), too_long='drop', **kwargs)
  ids = CharTokenizer().encode_batch(['ab', 'cd', 'e'])
  assert rows['chosen'].shape == rows['rejected'].shape == (1, 8)
  np.testing.assert_array_equal(rows['chosen'][0], ids[0] + ids[1] + [EOS] * 4)
  np.testing.assert_array_equal(rows['rejected'][0], ids[0] + ids[2] + [EOS] * 5)
  assert rows['prompt_lengths'].tolist() == [2]
  cut = preference_rows.pair_rows(pairs, CharTokenizer(), too_long='truncate', **kwargs)
  assert len(cut['chosen']) == 2  # f:2's rejected cut to the canvas; f:3's prompt fills it
  with pytest.raises(DataError, match='f:2: prompt \\+ response \\+ EOS is 10 tokens'):
    preference_rows.pair_rows(pairs, CharTokenizer(), too_long='error', **kwargs)


def test_builtin_pairs_prefer_a_correct_solution_to_a_wrong_one(tmp_path):
  path = preference_rows.ensure_builtin_pairs(str(tmp_path), split='test')
  assert preference_rows.ensure_builtin_pairs(str(tmp_path), split='test') == path  # cached
  rows = [json.loads(line) for line in open(path)]
  assert {r['task'] for r in rows} == set(sft_rows.BUILTIN_TASKS)
  for row in rows[::7]:
    task = tasks.TASKS[row['task']]
    example = next(e for e in task.examples('test', 64, 0) if e.prompt == row['prompt'])
    assert task.reward(example, row['chosen']) > task.reward(example, row['rejected'])


@pytest.mark.parametrize('task', sft_rows.BUILTIN_TASKS)
def test_near_miss_pairs_are_judged_right_over_wrong(task):
  """The task's own judge calls every chosen right and every rejected wrong; the rejected is the
  same problem's solution, and for arithmetic and sudoku differs only in the final answer."""
  rows = preference_rows.task_pairs(task, 'test', 48, seed=3, kind='near_miss')
  examples = {e.prompt: e for e in tasks.TASKS[task].examples('test', 48, 3)}
  judge = tasks.TASKS[task]
  assert len(rows) == 48
  for row in rows:
    example = examples[row['prompt']]
    assert row['chosen'] == example.response and row['rejected'] != row['chosen']
    assert judge.is_correct(example, row['chosen'])
    assert not judge.is_correct(example, row['rejected'])
    assert judge.reward(example, row['rejected']) < judge.reward(example, row['chosen'])
  if task == 'arithmetic':  # the last step's result and the answer slip together
    for row in rows:
      chosen, rejected = row['chosen'], row['rejected']
      right, wrong = (t.split('<answer>\n')[1].split('\n')[0] for t in (chosen, rejected))
      assert rejected == chosen.replace(f'={right}\n', f'={wrong}\n').replace(
        f'<answer>\n{right}\n', f'<answer>\n{wrong}\n'
      )
      assert 0 < abs(int(wrong) - int(right)) <= 10
  if task == 'sudoku4':  # one cell of the grid
    for row in rows:
      diff = [i for i, (a, b) in enumerate(zip(row['chosen'], row['rejected'])) if a != b]
      assert len(diff) == 1 and len(row['chosen']) == len(row['rejected'])
  if task.startswith('countdown'):  # the same numbers, the value off the target
    for row in rows:
      example = examples[row['prompt']]
      expression = tasks.base.last_answer(row['rejected'])
      numbers = re.findall(r'\d+', example.prompt.split(' to make ')[0])
      assert sorted(re.findall(r'\d+', expression), key=int) == sorted(numbers, key=int)


def test_the_builtin_pair_kind_is_named_by_the_file_setting(tmp_path):
  assert preference_rows.builtin_kind('builtin') == 'other'
  assert preference_rows.builtin_kind('builtin:near_miss') == 'near_miss'
  assert preference_rows.builtin_kind('pairs.jsonl') is None
  with pytest.raises(DataError, match="'builtin:nope': the built-in pairs are builtin:KIND"):
    preference_rows.builtin_kind('builtin:nope')
  other = preference_rows.ensure_builtin_pairs(str(tmp_path), split='test')
  near = preference_rows.ensure_builtin_pairs(str(tmp_path), split='test', kind='near_miss')
  assert other != near
  rows = [json.loads(line) for line in open(near)]
  assert {r['task'] for r in rows} == set(sft_rows.BUILTIN_TASKS)
