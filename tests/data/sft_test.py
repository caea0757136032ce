"""SFT rows: rendering, EOS padding, packing, the too-long switch, resumable batches."""

import json
import os

import numpy as np
import pytest

from dlmjax.data import chat
from dlmjax.train import sft_rows as sft
from dlmjax.data.errors import DataError
from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from tests.conftest import tiny_test_config

EOS = 2


class CharTokenizer:
  """One id per character (4 + code point mod 90): lengths are easy to reason about."""

  def encode_batch(self, texts):
    return [[4 + ord(c) % 90 for c in text] for text in texts]


def write_jsonl(path, rows):
  path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
  return str(path)


def test_rows_of_both_formats_are_rendered_with_the_template(tmp_path):
  path = write_jsonl(
    tmp_path / 'a.jsonl',
    [
      {'prompt': 'Hi?', 'response': 'Hello.'},
      {'messages': [{'role': 'user', 'content': 'Q'}, {'role': 'assistant', 'content': 'A'}]},
    ],
  )
  rows = sft.read_conversations(path, 'chatml')
  assert rows == [
    (f'{path}:1', chat.prompt_text('chatml', 'Hi?'), 'Hello.'),
    (f'{path}:2', chat.prompt_text('chatml', 'Q'), 'A'),
  ]


@pytest.mark.parametrize(
  'row,message',
  [
    ({'prompt': 'x', 'response': '  '}, r'b.jsonl:2: the response is empty'),
    ('{"prompt": ', r'b.jsonl:2: bad JSON'),
    ({'prompt': 'x'}, r'b.jsonl:2: a row needs string "prompt" and "response"'),
    (
      {'messages': [{'role': 'robot', 'content': 'x'}, {'role': 'assistant', 'content': 'y'}]},
      r"b.jsonl:2: .*role 'robot'",
    ),
  ],
)
def test_bad_rows_name_the_file_and_line(tmp_path, row, message):
  path = write_jsonl(tmp_path / 'b.jsonl', [{'prompt': 'ok', 'response': 'ok'}, row])
  with pytest.raises(DataError, match=message):
    sft.read_conversations(path, 'plain')


def test_padded_rows_carry_prompt_response_and_eos_padding():
  conversations = [(1, 'abc', 'de'), (2, 'f', 'ghij')]
  encoded, report = sft.encode_conversations(
    conversations, CharTokenizer(), eos_id=EOS, canvas=8, too_long='error'
  )
  assert report.rows == 2 and report.tokens == 6 + 6
  rows = sft.padded_rows(encoded, eos_id=EOS, width=9)
  t, r = rows['tokens'], rows['roles']
  assert t.shape == r.shape == (2, 9)
  np.testing.assert_array_equal(r[0], [PROMPT] * 3 + [RESPONSE] * 3 + [PADDING] * 3)
  np.testing.assert_array_equal(r[1], [PROMPT] * 1 + [RESPONSE] * 5 + [PADDING] * 3)
  assert t[0, 5] == EOS and (t[:, 6:] == EOS).all()  # the answer's EOS, then EOS padding
  np.testing.assert_array_equal(t[1, :5], CharTokenizer().encode_batch(['fghij'])[0])


def test_too_long_rows_follow_the_switch():
  conversations = [('f:1', 'ab', 'cd'), ('f:2', 'abcd', 'efghij'), ('f:3', 'abcdefgh', 'x')]
  kwargs = dict(eos_id=EOS, canvas=8)
  with pytest.raises(DataError, match='f:2: prompt \\+ response \\+ EOS is 11 tokens'):
    sft.encode_conversations(conversations, CharTokenizer(), too_long='error', source='f', **kwargs)
  kept, report = sft.encode_conversations(conversations, CharTokenizer(), too_long='drop', **kwargs)
  assert (len(kept), report.dropped, report.truncated) == (1, 2, 0)
  kept, report = sft.encode_conversations(
    conversations, CharTokenizer(), too_long='truncate', **kwargs
  )
  # Row 2 is cut to the canvas (no EOS: the answer goes on); row 3's prompt fills it: dropped.
  assert (len(kept), report.dropped, report.truncated) == (2, 1, 1)
  assert len(kept[1][0]) + len(kept[1][1]) == 8 and kept[1][1][-1] != EOS
  assert '1 truncated, 1 dropped' in report.summary()


def test_packing_keeps_every_conversation_whole_and_in_order():
  rng = np.random.default_rng(0)
  encoded = [
    (
      list(rng.integers(4, 90, rng.integers(1, 5))),
      list(rng.integers(4, 90, rng.integers(1, 5))) + [EOS],
    )
    for _ in range(40)
  ]
  rows = sft.packed_rows(encoded, eos_id=EOS, width=17, canvas=16)
  t, r, s = rows['tokens'], rows['roles'], rows['segment_ids']
  assert (r[:, -1] == PADDING).all() and (s[r == PADDING] == 0).all()
  rebuilt = []
  for i in range(len(t)):
    for segment in range(1, s[i].max() + 1):
      chosen = s[i] == segment
      prompt = t[i][chosen & (r[i] == PROMPT)]
      answer = t[i][chosen & (r[i] == RESPONSE)]
      assert np.ptp(np.nonzero(chosen)[0]) == chosen.sum() - 1  # contiguous
      rebuilt.append((list(prompt), list(answer)))
  assert rebuilt == encoded
  assert len(t) < len(encoded) / 2  # actually packed


def _rows(n=10, width=9):
  return {
    'tokens': np.arange(n * width, dtype=np.int32).reshape(n, width),
    'roles': np.ones((n, width), np.int32),
  }


def test_batches_are_deterministic_sharded_and_resumable():
  config = tiny_test_config(**{'train.global_batch_size': 4, 'train.steps': 6})
  rows = _rows()
  whole = [b['tokens'][:, 0] // 9 for b in sft.make_batch_iterator(config, rows=rows)]
  assert len(whole) == 6
  # Each epoch of 10 rows is a permutation: the first 8 draws have no repeats within an epoch.
  first_epoch = np.concatenate(whole)[:10]
  assert sorted(first_epoch) == list(range(10))
  assert not np.array_equal(np.concatenate(whole)[10:20], first_epoch)  # reshuffled
  # Two processes read the two halves of every global batch.
  halves = [
    list(sft.make_batch_iterator(config, rows=rows, process_index=p, process_count=2))
    for p in range(2)
  ]
  for k, batch in enumerate(whole):
    np.testing.assert_array_equal(
      np.concatenate([h[k]['tokens'][:, 0] // 9 for h in halves]), batch
    )
  # Resume: a new iterator set to the state after 3 batches continues with batch 3.
  it = sft.make_batch_iterator(config, rows=rows)
  for _ in range(3):
    next(it)
  state = it.get_state()
  assert state == {'consumed_samples': 12}
  resumed = sft.make_batch_iterator(config, rows=rows)
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed)['tokens'][:, 0] // 9, whole[3])


def test_builtin_set_is_generated_once_from_the_tasks(tmp_path, monkeypatch):
  monkeypatch.setattr(sft, 'BUILTIN_EXAMPLES_PER_TASK', 3)
  path = sft.ensure_builtin_set(str(tmp_path))
  lines = [json.loads(line) for line in open(path)]
  assert len(lines) == 3 * len(sft.BUILTIN_TASKS)
  assert {row['task'] for row in lines} == set(sft.BUILTIN_TASKS)
  assert all(row['prompt'] and row['response'].strip() for row in lines)
  assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left behind
  mtime = os.path.getmtime(path)
  assert sft.ensure_builtin_set(str(tmp_path)) == path and os.path.getmtime(path) == mtime


def test_builtin_held_out_set_shares_no_problem_with_training(tmp_path, monkeypatch):
  monkeypatch.setattr(sft, 'BUILTIN_EXAMPLES_PER_TASK', 20)
  monkeypatch.setattr(sft, 'BUILTIN_HELD_OUT_PER_TASK', 5)
  train = [json.loads(line) for line in open(sft.ensure_builtin_set(str(tmp_path)))]
  test = [json.loads(line) for line in open(sft.ensure_builtin_set(str(tmp_path), split='test'))]
  assert len(test) == 5 * len(sft.BUILTIN_TASKS)
  assert not {r['prompt'] for r in train} & {r['prompt'] for r in test}
  config = tiny_test_config(**{'stage': 'sft'})
  config.sft.train_file = 'mine.jsonl'  # a user's own data: no built-in held-out set for it
  with pytest.raises(DataError, match='sft.eval_file'):
    sft.eval_file(config)


def test_build_rows_with_the_builtin_tokenizer(tmp_path):
  config = tiny_test_config(**{'stage': 'sft', 'model.seq_len': 32})
  if os.environ.get('DLMJAX_CACHE_DIR'):
    config.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  config.sft.train_file = write_jsonl(
    tmp_path / 'c.jsonl',
    [{'prompt': 'Compute 2+2.', 'response': '4'}, {'prompt': 'x' * 200, 'response': 'y'}],
  )
  logged = []
  rows = sft.build_rows(config, log=logged.append)
  assert rows['tokens'].shape == (1, 33) and '1 dropped' in logged[0]
  assert rows['tokens'].max() < config.model.vocab_size


def test_builtin_train_file_names_the_tasks_it_trains_on(tmp_path, monkeypatch):
  monkeypatch.setattr(sft, 'BUILTIN_EXAMPLES_PER_TASK', 4)
  monkeypatch.setattr(sft, 'BUILTIN_HELD_OUT_PER_TASK', 3)
  config = tiny_test_config(**{'stage': 'sft', 'data.cache_dir': str(tmp_path)})
  config.sft.train_file = 'builtin:sudoku4,arithmetic'
  train = [json.loads(line) for line in open(sft.train_file(config))]
  test = [json.loads(line) for line in open(sft.eval_file(config))]
  assert [r['task'] for r in train] == ['sudoku4'] * 4 + ['arithmetic'] * 4
  assert [r['task'] for r in test] == ['sudoku4'] * 3 + ['arithmetic'] * 3
  assert not {r['prompt'] for r in train} & {r['prompt'] for r in test}
  # The same rows as the whole set's, and the whole set keeps its cache file.
  whole = [json.loads(line) for line in open(sft.ensure_builtin_set(str(tmp_path)))]
  assert [r for r in whole if r['task'] in ('sudoku4', 'arithmetic')] == train
  assert len(os.listdir(tmp_path)) == 3
  for bad in ('builtin:sudoku9', 'builtin:'):
    config.sft.train_file = bad
    with pytest.raises(DataError, match='builtin:TASK.*countdown3, countdown4, sudoku4'):
      sft.train_file(config)
