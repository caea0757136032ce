"""The grain input pipeline of pre-training: config -> Megatron-ordered global batches per process.

Batch k holds samples [k*GBS, (k+1)*GBS) of the split in order, and process p takes rows
[p*GBS/P, (p+1)*GBS/P), as Megatron's pretraining sampler deals them to data-parallel ranks.
The iterator's state is the number of samples consumed (Megatron's consumed_samples), so a
checkpoint resumes exactly and stays valid when the worker or host count changes.
"""

from __future__ import annotations

import os

from absl import flags
import grain
import numpy as np

from dlmjax.data import blend
from dlmjax.data import builtin
from dlmjax.data import tfds_source
from dlmjax.data.errors import DataError


def cache_dir(config) -> str:
  """data.cache_dir, '' meaning ~/.cache/dlmjax."""
  return config.data.cache_dir or builtin.default_cache_dir()


def _blend_and_split(config, split: str) -> tuple[str, str | None]:
  """Which prefixes a split reads and how they are cut.

  builtin: the built-in corpus cut by data.split. tfds:NAME:SPLIT: that split, tokenized and
  cut by data.split. megatron: data.train_prefixes cut by data.split; or, when
  data.valid_prefixes is set, each whole (Megatron's --train-data-path / --valid-data-path),
  with no test split.
  """
  data = config.data
  if data.source == 'builtin':
    corpus = builtin.ensure_builtin_corpus(cache_dir(config), vocab_size=config.model.vocab_size)
    return corpus.prefix, data.split
  if data.source.startswith(tfds_source.PREFIX):
    return tfds_source.ensure_tfds_prefix(config, cache_dir(config)), data.split
  if data.source != 'megatron':
    raise DataError(
      f"data.source {data.source!r} is not 'builtin', 'megatron' or 'tfds:NAME:SPLIT'"
    )
  if not data.valid_prefixes:
    return data.train_prefixes, data.split
  if split == 'train':
    return data.train_prefixes, None
  if split == 'valid':
    return data.valid_prefixes, None
  raise DataError(
    f'no {split} data: with data.valid_prefixes set, each split reads its own '
    'prefixes whole; clear data.valid_prefixes to cut all splits by data.split.'
  )


def make_dataset(config, split: str = 'train'):
  """The samples of one split: a random-access dataset of int32 [seq_len + 1].

  The train split is sized for train.steps x train.global_batch_size samples (Megatron); valid
  and test are one epoch.
  """
  if split not in blend.SPLITS:
    raise DataError(f'split {split!r} is not one of {blend.SPLITS}')
  prefixes, split_string = _blend_and_split(config, split)
  num_samples = config.train.steps * config.train.global_batch_size if split == 'train' else None
  return blend.build_dataset(
    prefixes,
    split=split_string,
    name=split,
    num_samples=num_samples,
    seq_len=config.model.seq_len,
    seed=config.seed,
    vocab_size=config.model.vocab_size,
    cache_dir=os.path.join(cache_dir(config), 'indices'),
  )


def make_train_source(config) -> grain.MapDataset:
  """The training samples (np.int32 [seq_len + 1]) as a grain MapDataset, in Megatron order."""
  return grain.MapDataset.source(make_dataset(config, 'train'))


def document_segment_ids(tokens_BS: np.ndarray, eod_id: int) -> np.ndarray:
  """1-based document index of each token within its row; a document ends at (and includes)
  an end-of-document token, so a new one starts right after it."""
  ends_BS = (tokens_BS == eod_id).astype(np.int32)
  return (1 + np.cumsum(ends_BS, axis=1) - ends_BS).astype(np.int32)


class _ReadBatch:
  """Batch k -> this process's rows of it; a class so worker processes can pickle it."""

  def __init__(
    self, samples, global_batch_size: int, rows: int, first_row: int, eod_id: int | None = None
  ):
    self.samples, self.global_batch_size = samples, global_batch_size
    self.rows, self.first_row, self.eod_id = rows, first_row, eod_id

  def __call__(self, k: int) -> dict[str, np.ndarray]:
    start = int(k) * self.global_batch_size + self.first_row
    tokens = np.stack([self.samples[i] for i in range(start, start + self.rows)])
    if self.eod_id is None:
      return {'tokens': tokens}
    return {'tokens': tokens, 'segment_ids': document_segment_ids(tokens, self.eod_id)}


class BatchIterator(grain.DatasetIterator):
  """Batches of one process, prefetched by grain; state = {'consumed_samples': k * GBS}.

  Any prefetched batch not yet returned is simply read again after set_state. The inner grain
  pipeline starts lazily, so a set_state right after creation costs nothing.
  """

  def __init__(
    self, batches: grain.MapDataset, global_batch_size: int, prefetch: int, num_workers: int
  ):
    super().__init__()
    self._batches, self._global_batch_size = batches, global_batch_size
    self._prefetch, self._num_workers = prefetch, num_workers
    self._next_batch = 0
    self._inner = None

  def _start(self):
    # Elements are whole batches, so a couple of reader threads keep `prefetch` batches ready.
    read = grain.ReadOptions(
      num_threads=min(self._prefetch, 2), prefetch_buffer_size=self._prefetch
    )
    dataset = self._batches[self._next_batch :].to_iter_dataset(read)
    if self._num_workers > 0:
      # grain's worker processes read absl flags; outside an absl app, take their defaults.
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
      dataset = dataset.mp_prefetch(
        grain.MultiprocessingOptions(
          num_workers=self._num_workers, per_worker_buffer_size=max(1, self._prefetch)
        )
      )
    self._inner = iter(dataset)

  def __next__(self) -> dict[str, np.ndarray]:
    if self._inner is None:
      self._start()
    batch = next(self._inner)
    self._next_batch += 1
    return batch

  def __len__(self) -> int:
    """Batches left."""
    return len(self._batches) - self._next_batch

  def get_state(self) -> dict[str, int]:
    return {'consumed_samples': self._next_batch * self._global_batch_size}

  def set_state(self, state: dict[str, int]):
    consumed = int(state['consumed_samples'])
    if consumed % self._global_batch_size:
      raise DataError(
        f'cannot resume at {consumed} consumed samples with global batch size '
        f'{self._global_batch_size}: it must divide the consumed count.'
      )
    self._close_inner()
    self._next_batch = consumed // self._global_batch_size

  def start_prefetch(self):
    if self._inner is None:
      self._start()
    self._inner.start_prefetch()

  def _close_inner(self):
    if self._inner is not None:
      self._inner.close()
      self._inner = None

  def close(self):
    self._close_inner()
    super().close()


def make_batch_iterator(
  config, *, split: str = 'train', process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
  """Yields {'tokens': np.int32 [global_batch_size // process_count, seq_len + 1]}, plus
  'segment_ids' of the same shape when data.packing is on.

  Deterministic given the config; checkpoint it with get_state() / set_state().
  """
  global_batch_size = config.train.global_batch_size
  if global_batch_size % process_count:
    raise DataError(
      f'train.global_batch_size {global_batch_size} is not divisible by the '
      f'{process_count} processes; make it a multiple.'
    )
  samples = make_dataset(config, split)
  num_batches = len(samples) // global_batch_size
  if num_batches == 0:
    raise DataError(
      f'the {split} split has {len(samples)} samples, fewer than one global batch '
      f'of {global_batch_size}; use more data or a smaller batch or seq_len.'
    )
  rows = global_batch_size // process_count
  batches = grain.MapDataset.range(num_batches).map(
    _ReadBatch(
      samples,
      global_batch_size,
      rows,
      process_index * rows,
      config.model.eos_token_id if config.data.packing else None,
    )
  )
  return BatchIterator(batches, global_batch_size, config.data.prefetch, config.data.num_workers)
