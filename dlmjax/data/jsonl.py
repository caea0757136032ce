"""JSONL text -> Megatron indexed datasets, as Megatron's tools/preprocess_data.py makes them.

One JSON line is one document; each key in json_keys becomes its own dataset
`{output_prefix}_{key}_document`. Workers tokenize chunks of lines in parallel and the results are
written in input order. Malformed lines are skipped, but counted and reported by line number.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from dlmjax.data import indexed
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

_CHUNK_LINES = 64  # lines per worker task: large enough to amortise the pickling.
_REPORTED_BAD_LINES = 5


@dataclasses.dataclass
class Report:
  """What a preprocessing run did; bad_lines holds the first few (line number, reason)."""

  documents: int = 0
  tokens: int = 0
  num_bad_lines: int = 0
  bad_lines: list = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  prefixes: dict = dataclasses.field(default_factory=dict)  # json key -> output prefix.

  def summary(self) -> str:
    rate = (
      f'{self.documents / max(self.seconds, 1e-9):,.0f} docs/s, '
      f'{self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s'
    )
    text = f'{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s ({rate})'
    if self.num_bad_lines:
      listed = '; '.join(f'line {n}: {why}' for n, why in self.bad_lines)
      text += f'; skipped {self.num_bad_lines} malformed lines (first: {listed})'
    return text


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(1-based line number, raw line) of a .jsonl or .jsonl.gz file."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rb') as f:
    yield from enumerate(f, start=1)


def read_objects(path: str, error=DataError) -> Iterator[tuple[int, dict]]:
  """(1-based line number, JSON object) of each non-blank line of a .jsonl(.gz) file, for the
  readers that refuse a bad row (SFT data, prompts, evaluation pairs, GSM8K): `error` is raised
  naming the file and line."""
  if not os.path.isfile(path):
    raise error(f'{path} does not exist; pass the path of a jsonl file.')
  for number, line in read_lines(path):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode('utf-8'))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise error(f'{path}:{number}: bad JSON ({getattr(e, "msg", e)}).') from None
    if not isinstance(record, dict):
      raise error(f'{path}:{number}: a JSON {type(record).__name__}, not an object.')
    yield number, record


def write_objects(path: str, objects) -> str:
  """Writes one JSON line per object to a temporary file, then renames it into place: a reader
  never sees half a file (the built-in SFT rows and preference pairs, the demo's sets)."""
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w') as f:
    for obj in objects:
      f.write(json.dumps(obj) + '\n')
  os.replace(tmp, path)
  return path


def encode_line(line: bytes, keys: Sequence[str], tokenizer, append_eod: bool):
  """{key: (token ids, sequence lengths)} of one line, or a str saying why it is malformed.

  A key's value is a string, or a list of strings (sentences: one sequence each, as Megatron).
  End-of-document goes after the last token of non-empty documents only, as Megatron does.
  """
  try:
    record = json.loads(line.decode('utf-8'))
  except UnicodeDecodeError:
    return 'not UTF-8'
  except json.JSONDecodeError as e:
    return f'bad JSON ({e.msg})'
  if not isinstance(record, dict):
    return f'a JSON {type(record).__name__}, not an object'
  encoded = {}
  for key in keys:
    if key not in record:
      return f'no key {key!r}'
    text = record[key]
    sentences = text if isinstance(text, list) else [text]
    if not all(isinstance(s, str) for s in sentences):
      return f'{key!r} is not a string or a list of strings'
    pieces = [ids for ids in (tokenizer.encode(s) for s in sentences) if ids]
    lengths = [len(ids) for ids in pieces]
    ids = list(itertools.chain.from_iterable(pieces))
    if ids and append_eod:
      ids.append(tokenizer.eod_id)
      lengths[-1] += 1
    encoded[key] = (np.asarray(ids, np.int64), lengths)
  return encoded


_worker_state = {}


def _init_worker(tokenizer, keys, append_eod):
  _worker_state.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod)


def _encode_chunk(chunk):
  s = _worker_state
  return [(n, encode_line(line, s['keys'], s['tokenizer'], s['append_eod'])) for n, line in chunk]


def _chunks(lines, size):
  while chunk := list(itertools.islice(lines, size)):
    yield chunk


def _ordered_map(pool, fn, items, window):
  """pool.imap with backpressure: imap reads all its input ahead, which big files cannot afford."""
  pending = collections.deque()
  for item in items:
    pending.append(pool.apply_async(fn, (item,)))
    if len(pending) >= window:
      yield pending.popleft().get()
  while pending:
    yield pending.popleft().get()


def preprocess_jsonl(
  input_path: str,
  output_prefix: str,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  json_keys: Sequence[str] = ('text',),
  append_eod: bool = False,
  workers: int = 1,
  log_every_s: float = 10.0,
  log=None,
) -> Report:
  """Tokenizes a JSONL file into one indexed dataset per key; returns what it did."""
  log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
  if not os.path.isfile(input_path):
    raise DataError(f'no input file {input_path!r}: give a .jsonl or .jsonl.gz file.')
  os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)  # as the user meant
  report = Report(prefixes={k: f'{output_prefix}_{k}_document' for k in json_keys})
  dtype = indexed.optimal_dtype(tokenizer.vocab_size)
  writers = {k: indexed.IndexedDatasetWriter(p, dtype) for k, p in report.prefixes.items()}
  start = last_log = time.perf_counter()
  chunks = _chunks(read_lines(input_path), _CHUNK_LINES)
  args = (tokenizer, tuple(json_keys), append_eod)
  pool = (
    multiprocessing.get_context('spawn').Pool(workers, _init_worker, args) if workers > 1 else None
  )
  try:
    if pool is None:
      _init_worker(*args)
      results = map(_encode_chunk, chunks)
    else:
      results = _ordered_map(pool, _encode_chunk, chunks, window=4 * workers)
    for chunk in results:
      for line_number, encoded in chunk:
        if isinstance(encoded, str):
          report.num_bad_lines += 1
          if len(report.bad_lines) < _REPORTED_BAD_LINES:
            report.bad_lines.append((line_number, encoded))
          continue
        for key, (ids, lengths) in encoded.items():
          writers[key].add_document(ids, lengths)
          report.tokens += len(ids)
        report.documents += 1
      now = time.perf_counter()
      if now - last_log >= log_every_s:
        last_log, report.seconds = now, now - start
        log(f'preprocess: {report.summary()}')
  except BaseException:
    for writer in writers.values():
      writer.abort()
    raise
  finally:
    if pool is not None:
      pool.terminate()
  for writer in writers.values():
    writer.close()
  report.seconds = time.perf_counter() - start
  log(
    f'preprocess: done, {report.summary()}; wrote '
    f'{", ".join(p + ".bin/.idx" for p in report.prefixes.values())}'
  )
  return report
