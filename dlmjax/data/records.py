"""Rows of a data source as dicts: our jsonl, or any Hugging Face `datasets` dataset.

A source is a path or a cached hub dataset:
  rows.jsonl                      read line by line (our reader: errors name the line)
  rows.parquet | .json | .arrow | .csv, or a directory of them, or a glob
                                  read with `datasets` (streaming: no Arrow copy is written)
  DIR saved by Dataset.save_to_disk  read with datasets.load_from_disk (memory-mapped)
  hub:NAME[:CONFIG][@SPLIT]       a hub dataset already in the `datasets` cache (never
                                  downloaded here: the machines may have no network)
Column mapping (data.columns, e.g. 'prompt=question,response=answer') renames a source's
columns to the names our readers want; columns not named pass through unchanged.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

from dlmjax.data import jsonl
from dlmjax.data.errors import DataError

HUB_PREFIX = 'hub:'
_BUILDERS = {
  '.parquet': 'parquet',
  '.json': 'json',
  '.jsonl': 'json',
  '.arrow': 'arrow',
  '.csv': 'csv',
}


def parse_columns(spec: str) -> dict[str, str]:
  """'prompt=question,response=answer' -> {'question': 'prompt', 'answer': 'response'}."""
  mapping = {}
  for item in filter(None, (part.strip() for part in spec.split(','))):
    ours, sep, theirs = item.partition('=')
    if not sep or not ours.strip() or not theirs.strip():
      raise DataError(
        f'data.columns item {item!r} is not OURS=THEIRS; write e.g. '
        "--config.data.columns='prompt=question,response=answer'."
      )
    mapping[theirs.strip()] = ours.strip()
  return mapping


def rename(row: dict, mapping: dict[str, str]) -> dict:
  """The row with its columns renamed by a parse_columns mapping (the rest pass through)."""
  if not mapping:
    return row
  missing = [theirs for theirs in mapping if theirs not in row]
  if missing:
    raise DataError(
      f'data.columns names {missing} but the rows have columns {sorted(row)}; fix data.columns.'
    )
  out = {k: v for k, v in row.items() if k not in mapping}
  out.update({ours: row[theirs] for theirs, ours in mapping.items()})
  return out


def _files_of(source: str) -> list[str]:
  if os.path.isdir(source):
    return sorted(
      os.path.join(source, name)
      for name in os.listdir(source)
      if os.path.splitext(name)[1] in _BUILDERS
    )
  if os.path.isfile(source):
    return [source]
  return sorted(glob.glob(source))


def _datasets_rows(builder: str, files: list[str], streaming: bool) -> Iterator[dict]:
  import datasets  # pylint: disable=import-outside-toplevel  # heavy, and only this path needs it

  if builder == 'arrow':
    streaming = False  # the arrow builder maps the files: already no copy
  dataset = datasets.load_dataset(builder, data_files=files, split='train', streaming=streaming)
  yield from dataset


def _saved_rows(path: str) -> Iterator[dict]:
  import datasets  # pylint: disable=import-outside-toplevel

  dataset = datasets.load_from_disk(path)
  if isinstance(dataset, datasets.DatasetDict):
    raise DataError(f'{path} holds splits {sorted(dataset)}; pass the directory of one split.')
  yield from dataset


@contextlib.contextmanager
def _offline(datasets):
  """The hub's offline switches on while loading: the cache answers, the network is not tried."""
  import huggingface_hub.constants as hub  # pylint: disable=import-outside-toplevel

  saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE)
  datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
  try:
    yield
  finally:
    datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _hub_rows(spec: str) -> Iterator[dict]:
  import datasets  # pylint: disable=import-outside-toplevel

  name, _, split = spec.partition('@')
  name, _, subset = name.partition(':')
  try:
    with _offline(datasets):
      dataset = datasets.load_dataset(
        name, subset or None, split=split or 'train', download_mode='reuse_cache_if_exists'
      )
  except Exception as e:  # pylint: disable=broad-except  # network, missing cache, bad split
    raise DataError(
      f'{HUB_PREFIX}{spec}: not in the local `datasets` cache ({type(e).__name__}: '
      f'{str(e).splitlines()[0] if str(e) else ""}); download it where there is network '
      '(datasets.load_dataset) or pass a local parquet/jsonl path.'
    ) from e
  yield from dataset


def read_records(
  source: str, *, columns: str = '', streaming: bool = True
) -> Iterator[tuple[str, dict]]:
  """(where, row) of every row of a source, columns renamed by the data.columns spec.

  `where` names the row in error messages ('file:line' for jsonl, 'source#index' otherwise)."""
  mapping = parse_columns(columns)
  if source.startswith(HUB_PREFIX):
    rows = ((f'{source}#{i}', row) for i, row in enumerate(_hub_rows(source[len(HUB_PREFIX) :])))
  elif source.endswith('.jsonl') and os.path.isfile(source):
    rows = ((f'{source}:{n}', row) for n, row in jsonl.read_objects(source))
  elif os.path.isfile(os.path.join(source, 'state.json')):
    rows = ((f'{source}#{i}', row) for i, row in enumerate(_saved_rows(source)))
  else:
    files = _files_of(source)
    if not files:
      raise DataError(
        f'data source {source!r} is not a file, directory or glob that exists; pass a '
        f'jsonl/parquet/json/arrow/csv path or {HUB_PREFIX}NAME[:CONFIG][@SPLIT].'
      )
    kinds = {_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
      raise DataError(
        f'data source {source!r} holds {sorted(map(str, kinds))} files; use one kind of '
        f'{sorted(_BUILDERS)} files per source.'
      )
    builder = kinds.pop()
    rows = (
      (f'{source}#{i}', row) for i, row in enumerate(_datasets_rows(builder, files, streaming))
    )
  for where, row in rows:
    if not isinstance(row, dict):
      raise DataError(f'{where}: a row must be an object with named columns.')
    yield where, rename(row, mapping)


def exists(source: str) -> bool:
  """Whether a source names something that can be read (hub names are checked when read)."""
  return (
    source.startswith(HUB_PREFIX)
    or os.path.isfile(os.path.join(source, 'state.json'))
    or bool(_files_of(source))
  )
