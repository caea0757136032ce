"""Shared data fixtures: the built-in corpus, built at most once per test session."""

import os

import pytest

from dlmjax.data import builtin


@pytest.fixture(scope='session')
def builtin_corpus(tmp_path_factory):
  """The default built-in corpus; set DLMJAX_CACHE_DIR to reuse it across sessions."""
  cache_dir = os.environ.get('DLMJAX_CACHE_DIR') or str(tmp_path_factory.mktemp('dlmjax_cache'))
  return builtin.ensure_builtin_corpus(cache_dir, vocab_size=4096)
