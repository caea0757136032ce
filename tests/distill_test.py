"""python -m dlmjax.distill's choice of rows: --keep correct keeps exactly the rows the task
judges correct, --retries decodes the wrong ones again at rising temperatures (the last try
kept), and a run left without rows or without answers to judge fails in one line."""

import zlib

import numpy as np
import pytest

from dlmjax import distill as distill_cli
from dlmjax import tasks as tasks_lib
from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from tests.checkpoint import tiny_run

NUM = 12
SAMPLER = ['--override', 'gen_length=16', '--override', 'steps=8', '--override', 'block_length=16']


class ParityTask(tasks_lib.Task):
  """Prompts `t10`, `t11`, ... (one word-level token each); a completion is correct when its
  text's checksum plus the example's index is even: about half the rows, tied to their example."""

  name = 'parity'

  def examples(self, split, num, seed):
    return [tasks_lib.Example(prompt=f't{10 + i}', response='', answer=str(i)) for i in range(num)]

  def is_correct(self, example, completion):
    return (zlib.crc32(completion.encode()) + int(example.answer)) % 2 == 0


@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
  """A tiny params-only run with a word-level tokenizer beside it (`tN` is id N)."""
  root = tmp_path_factory.mktemp('keep')
  tiny_run.make_run(root / 'teacher', **{'model.seq_len': 32})
  tiny_run.write_tokenizer(root / 'teacher')
  return root


def _distill(teacher, output, *flags):
  argv = ['--init-from', str(teacher / 'teacher'), '--output', str(output), '--task', 'parity']
  return distill_cli.main(argv + ['--num', str(NUM), '--batch-size', '8'] + SAMPLER + list(flags))


def test_keep_correct_keeps_exactly_the_rows_the_task_judges_correct(
  teacher, tmp_path, monkeypatch, capsys
):
  monkeypatch.setitem(tasks_lib.TASKS, 'parity', ParityTask())
  assert _distill(teacher, tmp_path / 'all.npz') == 0
  assert _distill(teacher, tmp_path / 'correct.npz', '--keep', 'correct') == 0
  out = capsys.readouterr().out.splitlines()
  every, kept = np.load(tmp_path / 'all.npz'), np.load(tmp_path / 'correct.npz')
  expected = []
  for i, (tokens, roles) in enumerate(zip(every['tokens'], every['roles'])):
    completion = list(tokens[roles == RESPONSE])
    if 2 in completion:  # the tiny run's EOS ends the completion
      completion = completion[: completion.index(2)]
    text = ' '.join(f't{t}' for t in completion)  # the word-level tokenizer's decode, by hand
    expected.append((zlib.crc32(text.encode()) + i) % 2 == 0)
  expected = np.array(expected)
  assert 0 < expected.sum() < NUM, expected  # a real mix of kept and dropped rows
  assert every['tokens'].shape[0] == NUM
  for key in ('tokens', 'roles', 'commit_steps'):
    np.testing.assert_array_equal(kept[key], every[key][expected])
  assert out[0].startswith(f'kept {NUM} of {NUM} decoded teacher rows (--keep all, ')
  assert out[1].startswith(f'kept {expected.sum()} of {NUM} decoded teacher rows (--keep correct')
  assert f'{expected.sum()} judged correct' in out[1]


def test_a_row_is_judged_on_its_completion_text_up_to_the_first_eos():
  """The judged text is the RESPONSE tokens before the first EOS (2), decoded; not the prompt,
  the EOS or the padding after it."""
  P, R, _ = PROMPT, RESPONSE, PADDING
  rows = {
    'tokens': np.array([[5, 6, 7, 2, 2], [5, 8, 2, 9, 9], [5, 6, 7, 8, 9]]),
    'roles': np.array([[P, R, R, R, _], [P, R, R, _, _], [P, P, R, R, R]]),
  }
  answers = ['t6 t7', 't8 t2', 't7 t8 t9']
  examples = [tasks_lib.Example(prompt='', response='', answer=a) for a in answers]

  class Exact(tasks_lib.Task):
    def is_correct(self, example, completion):
      return completion == example.answer

  decode = lambda ids: ' '.join(f't{t}' for t in ids)  # noqa: E731
  judged = distill_cli.judge(rows, examples, Exact(), decode, eos_id=2)
  assert judged.tolist() == [True, False, True]


def test_retries_decode_the_wrong_rows_again_and_keep_the_last_try():
  """Row i becomes correct at try i: with 2 retries row 3 stays wrong at its last try."""
  calls = []

  def decode_fn(indices, attempt):
    calls.append((list(indices), attempt))
    return {'tokens': np.stack([np.array([i, attempt]) for i in indices])}

  def judge_fn(rows, indices):
    return rows['tokens'][:, 1] >= rows['tokens'][:, 0]

  rows, correct = distill_cli.decode_judged(decode_fn, judge_fn, 4, retries=2)
  assert calls == [([0, 1, 2, 3], 0), ([1, 2, 3], 1), ([2, 3], 2)]
  assert rows['tokens'].tolist() == [[0, 0], [1, 1], [2, 2], [3, 2]]
  assert correct.tolist() == [True, True, True, False]
  calls.clear()
  distill_cli.decode_judged(decode_fn, judge_fn, 4, retries=0)
  assert calls == [([0, 1, 2, 3], 0)]


def test_a_retry_decodes_at_d3llms_next_temperature(teacher, tmp_path, monkeypatch):
  """The retries' sampler is the teacher's at temperature 0.1, 0.2, ..., on the wrong rows."""
  monkeypatch.setitem(tasks_lib.TASKS, 'parity', ParityTask())
  seen, build_rows = [], distill_cli.build_rows

  def recording(pretrained, ids, sampling, **kwargs):
    seen.append((len(ids), sampling.temperature, kwargs['seed']))
    return build_rows(pretrained, ids, sampling, **kwargs)

  monkeypatch.setattr(distill_cli, 'build_rows', recording)
  assert _distill(teacher, tmp_path / 'rows.npz', '--retries', '1', '--seed', '3') == 0
  assert seen[0] == (NUM, 0.0, 3)
  assert len(seen) == 2 and seen[1][1:] == (0.1, 4) and 0 < seen[1][0] < NUM


def test_rows_without_answers_or_left_empty_fail_in_one_line(teacher, tmp_path, capsys):
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text('{"prompt": "t5"}\n')
  argv = ['--init-from', str(teacher / 'teacher'), '--output', str(tmp_path / 'rows.npz')]
  assert distill_cli.main(argv + ['--prompts', str(prompts), '--keep', 'correct']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'drop --prompts or use --keep all' in err, err
  assert not (tmp_path / 'rows.npz').exists()
  rows = {'tokens': np.zeros((3, 4), np.int32)}
  with pytest.raises(ValueError, match='none of its 3 sudoku4 problems .*--keep all'):
    distill_cli.kept_rows(rows, np.zeros(3, bool), 'correct', 'sudoku4')
  assert distill_cli.kept_rows(rows, np.zeros(3, bool), 'all', 'sudoku4') is rows
