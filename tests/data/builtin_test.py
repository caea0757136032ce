"""The built-in stdlib corpus: contents, special ids, exact round trip, caching and atomicity."""

import os

import numpy as np
import pytest

from dlmjax.data import builtin
from dlmjax.data import indexed
from dlmjax.data import tokenizer as tokenizer_lib


def test_documents_are_bounded_deterministic_and_skip_tests():
  docs = builtin.stdlib_documents(max_chars=300_000)
  assert docs == builtin.stdlib_documents(max_chars=300_000)
  assert 0 < sum(len(t) for _, t in docs) <= 300_000
  for rel, _ in docs:
    parts = rel.split('/')
    assert not {'test', 'tests', 'site-packages', 'encodings'} & set(parts[:-1]), rel


def test_tokenizer_special_ids(builtin_corpus):
  tok = tokenizer_lib.load_tokenizer(builtin_corpus.tokenizer_path)
  assert tok.vocab_size == 4096
  assert (tok.pad_id, tok.piece_id('<unk>'), tok.eod_id, tok.mask_id) == (0, 1, 2, 3)


def test_corpus_is_the_tokenized_documents_with_eod(builtin_corpus):
  ds = indexed.IndexedDataset(builtin_corpus.prefix)
  directory = os.path.dirname(builtin_corpus.prefix)
  names = open(os.path.join(directory, 'documents.txt')).read().split()
  assert len(ds) == len(names) > 300
  assert ds.dtype == np.uint16 and 2_500_000 < ds.num_tokens < 6_000_000
  tokens = np.frombuffer(open(builtin_corpus.prefix + '.bin', 'rb').read(), np.uint16)
  assert tokens.max() < 4096
  assert np.count_nonzero(tokens == 2) == len(ds)  # exactly one eod per document, at its end.
  assert all(ds[i][-1] == 2 for i in range(len(ds)))
  tok = tokenizer_lib.load_tokenizer(builtin_corpus.tokenizer_path)
  rel, text = builtin.stdlib_documents()[0]
  assert names[0] == rel and tok.decode(ds[0][:-1]) == text


def test_second_call_is_cached(builtin_corpus, monkeypatch):
  """The second call reads the cache: building again would fail here."""
  cache_dir = os.path.dirname(os.path.dirname(builtin_corpus.prefix))

  def build(*args, **kwargs):
    raise AssertionError('the built-in corpus was built again')

  monkeypatch.setattr(builtin, '_build', build)
  assert builtin.ensure_builtin_corpus(cache_dir, vocab_size=4096) == builtin_corpus


def test_failed_build_leaves_no_cache(tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    raise RuntimeError('killed')

  monkeypatch.setattr(builtin, 'stdlib_documents', lambda: [('a.py', 'x = 1\n')])
  monkeypatch.setattr(tokenizer_lib, 'train_sentencepiece', fail)
  with pytest.raises(RuntimeError, match='killed'):
    builtin.ensure_builtin_corpus(str(tmp_path), vocab_size=512)
  assert [p for p in os.listdir(tmp_path) if not p.endswith('.lock')] == []
