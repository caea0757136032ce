"""The built-in corpus: the Python standard library's source and docs; training needs no download.

Every Python installation carries ~10 MB of real, varied text (code, docstrings, comments, the
language reference in pydoc_data), enough for ~3-4M tokens. The first call trains a SentencePiece
tokenizer on it and writes it as a Megatron indexed dataset; later calls find the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import NamedTuple

from dlmjax.data import indexed
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

FORMAT_VERSION = 1  # bump when the file choice, tokenizer settings or layout change.
MAX_CHARS = 12_000_000  # the whole corpus: ~3.5M tokens at vocab 4096.
MAX_FILE_CHARS = 1_000_000
TOKENIZER_CHARS = 4_000_000
_SUFFIXES = ('.py', '.txt', '.rst')
# Tests are repetitive, installed packages are not the stdlib, and encodings/ is codec tables.
_SKIP_DIRS = frozenset(
  {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__', 'encodings'}
)
PREFIX_NAME = 'corpus_text_document'
TOKENIZER_NAME = 'tokenizer.model'


class BuiltinCorpus(NamedTuple):
  prefix: str  # the indexed dataset: prefix + '.bin' / '.idx'.
  tokenizer_path: str  # the SentencePiece .model (pad 0, unk 1, eod 2, mask 3).


def default_cache_dir() -> str:
  return os.path.join(os.path.expanduser('~'), '.cache', 'dlmjax')


def stdlib_documents(max_chars: int = MAX_CHARS) -> list[tuple[str, str]]:
  """(relative path, text) of stdlib files, one document per file, in a fixed order.

  Files are found in sorted order and then ordered by a hash of their path, so the contiguous
  document ranges that a Megatron split takes (train/valid/test) each sample the whole library
  rather than its alphabetical tail. max_chars bounds the total.
  """
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  paths = []
  for directory, subdirs, files in os.walk(root):
    # Prune in place, so os.walk never enters site-packages or the test suites.
    subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS and not d.startswith('config-'))
    rel_dir = pathlib.Path(directory).relative_to(root)
    paths.extend((rel_dir / f).as_posix() for f in sorted(files) if f.endswith(_SUFFIXES))
  paths.sort(key=lambda rel: hashlib.md5(rel.encode()).hexdigest())
  docs, total = [], 0
  for rel in paths:
    text = (root / rel).read_text(encoding='utf-8', errors='replace')
    if not text.strip() or len(text) > MAX_FILE_CHARS:
      continue
    if total + len(text) > max_chars:
      break
    docs.append((rel, text))
    total += len(text)
  return docs


def _fingerprint(vocab_size: int) -> str:
  import sentencepiece  # pylint: disable=import-outside-toplevel

  key = json.dumps(
    [
      FORMAT_VERSION,
      vocab_size,
      sys.version,
      platform.python_implementation(),
      sentencepiece.__version__,
    ]
  )
  return (
    f'builtin-v{FORMAT_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}-'
    f'vocab{vocab_size}-{hashlib.md5(key.encode()).hexdigest()[:10]}'
  )


def _corpus(directory: str) -> BuiltinCorpus:
  return BuiltinCorpus(
    os.path.join(directory, PREFIX_NAME), os.path.join(directory, TOKENIZER_NAME)
  )


@contextlib.contextmanager
def _lock(path: str):
  """An exclusive lock, so concurrent processes on one host build once and the others wait.

  The atomic rename below is what keeps the cache whole; the lock only saves duplicate work.
  """
  with open(path, 'w') as f:
    try:
      import fcntl  # pylint: disable=import-outside-toplevel

      fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):
      pass  # no flock (Windows, some network filesystems): processes may build in parallel.
    yield


def _build(directory: str, vocab_size: int) -> dict:
  docs = stdlib_documents()
  texts = [text for _, text in docs]
  corpus = _corpus(directory)
  try:
    tokenizer_lib.train_sentencepiece(
      texts, corpus.tokenizer_path[: -len('.model')], vocab_size, max_chars=TOKENIZER_CHARS
    )
  except DataError as e:
    raise DataError(
      f'{e} The built-in corpus trains its own tokenizer, for which model.vocab_size '
      f'{vocab_size} is too large: use 4096 (the default).'
    ) from e
  tok = tokenizer_lib.load_tokenizer(corpus.tokenizer_path)
  num_tokens = 0
  with indexed.IndexedDatasetWriter(corpus.prefix, indexed.optimal_dtype(vocab_size)) as writer:
    for ids in tok.encode_batch(texts):
      writer.add_document(ids + [tok.eod_id])
      num_tokens += len(ids) + 1
  with open(os.path.join(directory, 'documents.txt'), 'w') as f:
    f.write(''.join(rel + '\n' for rel, _ in docs))
  meta = dict(
    format_version=FORMAT_VERSION,
    python=sys.version,
    vocab_size=vocab_size,
    num_documents=len(docs),
    num_chars=sum(map(len, texts)),
    num_tokens=num_tokens,
    stdlib=sysconfig.get_paths()['stdlib'],
  )
  with open(os.path.join(directory, 'meta.json'), 'w') as f:
    json.dump(meta, f, indent=1)
  return meta


def cached_corpus(cache_dir: str | None = None, vocab_size: int = 4096) -> BuiltinCorpus | None:
  """The built-in corpus if it is already built under cache_dir, else None (nothing is built)."""
  final = os.path.join(cache_dir or default_cache_dir(), _fingerprint(vocab_size))
  return _corpus(final) if os.path.isfile(os.path.join(final, 'meta.json')) else None


def ensure_builtin_corpus(cache_dir: str | None = None, vocab_size: int = 4096) -> BuiltinCorpus:
  """The built-in corpus and its tokenizer, built on the first call and cached under cache_dir.

  The cache is keyed by the Python build, vocab size and FORMAT_VERSION. It is built in a
  temporary directory and renamed into place, so a killed run or a concurrent one never leaves
  a half-written cache.
  """
  cache_dir = cache_dir or default_cache_dir()
  name = _fingerprint(vocab_size)
  final = os.path.join(cache_dir, name)
  if os.path.isfile(os.path.join(final, 'meta.json')):
    return _corpus(final)
  os.makedirs(cache_dir, exist_ok=True)
  with _lock(os.path.join(cache_dir, f'.{name}.lock')):
    if os.path.isfile(os.path.join(final, 'meta.json')):  # another process built it meanwhile.
      return _corpus(final)
    print(
      f'dlmjax: building the built-in corpus (Python {platform.python_version()} stdlib, '
      f'vocab {vocab_size}) in {final} ...',
      flush=True,
    )
    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=cache_dir)
    try:
      meta = _build(tmp, vocab_size)
      os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared.
      try:
        os.rename(tmp, final)
      except OSError:  # a process without the lock won the race: keep its identical cache.
        if not os.path.isfile(os.path.join(final, 'meta.json')):
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    print(
      f'dlmjax: built-in corpus ready: {meta["num_documents"]} documents, '
      f'{meta["num_tokens"]:,} tokens in {time.perf_counter() - start:.0f} s',
      flush=True,
    )
  return _corpus(final)
