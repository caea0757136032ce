"""JSONL -> indexed datasets: Megatron's document rules, order across workers, bad-line reports."""

import gzip
import json

import numpy as np
import pytest

from dlmjax.data import indexed
from dlmjax.data import jsonl
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

TEXTS = ['def f(x):\n    return x\n', 'hello world\n', 'class A:\n    pass\n'] * 10


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  prefix = tmp_path_factory.mktemp('tok') / 'tok'
  return tokenizer_lib.load_tokenizer(
    tokenizer_lib.train_sentencepiece(TEXTS, str(prefix), vocab_size=300)
  )


def _write_jsonl(path, lines):
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'wt', encoding='utf-8') as f:
    f.write(''.join(line + '\n' for line in lines))
  return str(path)


def test_encode_line_rules(tok):
  ids, lengths = jsonl.encode_line(b'{"text": "hello"}', ['text'], tok, True)['text']
  assert ids.tolist() == tok.encode('hello') + [2] and lengths == [len(ids)]
  ids, lengths = jsonl.encode_line(b'{"text": ["a", "", "b"]}', ['text'], tok, True)['text']
  assert lengths == [len(tok.encode('a')), len(tok.encode('b')) + 1]  # eod ends the last one.
  ids, lengths = jsonl.encode_line(b'{"text": ""}', ['text'], tok, True)['text']
  assert ids.size == 0 and lengths == []  # empty documents get no eod, as in Megatron.
  assert jsonl.encode_line(b'{"text": 1', ['text'], tok, True).startswith('bad JSON')
  assert jsonl.encode_line(b'{"txt": "a"}', ['text'], tok, True) == "no key 'text'"
  assert 'not a string' in jsonl.encode_line(b'{"text": 3}', ['text'], tok, True)
  assert 'not an object' in jsonl.encode_line(b'[1]', ['text'], tok, True)
  assert jsonl.encode_line(b'{"text": "\xff"}', ['text'], tok, True) == 'not UTF-8'


def test_preprocess_writes_megatron_documents_and_reports_bad_lines(tok, tmp_path):
  lines = [json.dumps({'text': t, 'title': 'x'}) for t in TEXTS]
  lines[3], lines[7] = 'oops', json.dumps({'text': None, 'title': 'x'})
  path = _write_jsonl(tmp_path / 'in.jsonl.gz', lines)
  logs = []
  report = jsonl.preprocess_jsonl(
    path, str(tmp_path / 'out'), tok, json_keys=['text', 'title'], append_eod=True, log=logs.append
  )
  assert report.documents == 28 and report.num_bad_lines == 2
  assert [n for n, _ in report.bad_lines] == [4, 8]
  assert 'skipped 2 malformed lines (first: line 4: bad JSON' in logs[-1]
  expected = str(tmp_path / 'expected')
  with indexed.IndexedDatasetWriter(expected, np.uint16) as writer:
    for i, text in enumerate(TEXTS):
      if i not in (3, 7):
        writer.add_document(tok.encode(text) + [tok.eod_id])
  for suffix in ('.bin', '.idx'):
    assert (
      open(report.prefixes['text'] + suffix, 'rb').read() == open(expected + suffix, 'rb').read()
    )
  assert report.prefixes['title'].endswith('out_title_document')
  assert len(indexed.IndexedDataset(report.prefixes['title'])) == 28


def test_workers_keep_input_order(tok, tmp_path):
  path = _write_jsonl(
    tmp_path / 'in.jsonl', [json.dumps({'text': f'{i} {t}'}) for i, t in enumerate(TEXTS * 5)]
  )
  one = jsonl.preprocess_jsonl(path, str(tmp_path / 'one'), tok, log=lambda _: None)
  two = jsonl.preprocess_jsonl(path, str(tmp_path / 'two'), tok, workers=2, log=lambda _: None)
  assert one.documents == two.documents == 150
  for suffix in ('.bin', '.idx'):
    assert (
      open(one.prefixes['text'] + suffix, 'rb').read()
      == open(two.prefixes['text'] + suffix, 'rb').read()
    )


def test_read_objects_names_the_file_and_line_of_a_bad_row(tmp_path):
  path = tmp_path / 'rows.jsonl'
  path.write_text('{"a": 1}\n\n{"b": 2}\n')
  assert list(jsonl.read_objects(str(path))) == [(1, {'a': 1}), (3, {'b': 2})]  # blanks skipped
  for text, message in (
    ('{"a": 1}\n{"a": \n', 'rows.jsonl:2: bad JSON'),
    ('[1, 2]\n', 'rows.jsonl:1: a JSON list, not an object'),
  ):
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
      list(jsonl.read_objects(str(path), error=ValueError))
  with pytest.raises(DataError, match='does not exist'):
    list(jsonl.read_objects(str(tmp_path / 'missing.jsonl')))
