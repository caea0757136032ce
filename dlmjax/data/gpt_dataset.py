"""Megatron's GPTDataset in numpy: fixed-length samples cut from shuffled, concatenated documents.

The three index arrays follow Megatron's gpt_dataset.py / helpers.cpp (reference section 3.3), so
the same data, split, seed and sample count give the same token stream as MegaDLMs:
  document_index: the split's documents tiled over the epochs and shuffled;
  sample_index:   (position in document_index, token offset) where each sample starts; sample k
                  covers tokens [k*S, k*S + S] of the concatenated stream, so neighbours overlap
                  by one token and samples run across document boundaries;
  shuffle_index:  the order in which samples are served.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np

from dlmjax.data import indexed
from dlmjax.data.errors import DataError

_INDEX_FORMAT = 1  # bump when the index arrays change meaning.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a short last epoch is shuffled on its own.


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_len: int) -> int:
  """The fewest epochs E with E*T >= num_samples*S + 1 (one epoch when num_samples is None)."""
  if num_samples is None:
    return 1
  return max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, num_samples: int | None, seq_len: int) -> bool:
  """Whether the last epoch is too short (< 80% of one) to mix into the global shuffle."""
  epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_len)
  if epochs == 1:
    return False
  samples_before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
  samples_in_final = num_samples - samples_before_final
  samples_per_epoch = (tokens_per_epoch - 1) // seq_len
  return samples_in_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(
  documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
  """The document ids tiled `epochs` times and shuffled together (int32, as Megatron)."""
  if separate_final and epochs > 1:
    first = build_document_index(documents, epochs - 1, rng, False)
    return np.concatenate([first, build_document_index(documents, 1, rng, False)])
  document_index = np.tile(np.asarray(documents), epochs).astype(np.int32)
  rng.shuffle(document_index)
  return document_index


def build_sample_index(
  sequence_lengths: np.ndarray, document_index: np.ndarray, seq_len: int
) -> np.ndarray:
  """[n + 1, 2] start of each sample: (position in document_index, offset in that document).

  Vectorised: sample k starts at token k*S of the concatenated stream, found by a binary search
  over the cumulative document ends. Partial last samples are dropped: n = (E*T - 1) // S.
  """
  lengths = sequence_lengths[document_index].astype(np.int64)
  ends = np.cumsum(lengths)
  num_samples = (int(ends[-1]) - 1) // seq_len if len(ends) else 0
  starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
  position = np.searchsorted(ends, starts, side='right')
  offset = starts - (ends[position] - lengths[position])
  position[0] = offset[0] = 0  # Megatron starts at (0, 0) even when the first document is empty.
  return np.stack([position, offset], axis=1)


def build_shuffle_index(
  num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
  """arange(total_size) with [0, num_samples) and [num_samples, total_size) shuffled apart."""
  dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
  first = np.arange(num_samples, dtype=dtype)
  rng.shuffle(first)
  if num_samples == total_size:
    return first
  last = np.arange(num_samples, total_size, dtype=dtype)
  rng.shuffle(last)
  return np.concatenate([first, last])


def cached_arrays(
  cache_dir: str | None, description: dict, build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
  """build() once per description, saved as .npy under cache_dir keyed by md5(description).

  Written through temporary files and renamed, so concurrent builders never read a partial file.
  """
  if not cache_dir:
    return build()
  text = json.dumps(description, sort_keys=True, indent=1)
  stem = os.path.join(
    cache_dir,
    f'{hashlib.md5(text.encode()).hexdigest()}-{description["kind"]}-{description["name"]}',
  )
  names = description['arrays']
  try:
    return {n: np.load(f'{stem}-{n}.npy', mmap_mode='r') for n in names}
  except (FileNotFoundError, ValueError):
    pass
  arrays = build()
  os.makedirs(cache_dir, exist_ok=True)
  for n in names:
    tmp = f'{stem}-{n}.tmp{os.getpid()}.npy'
    np.save(tmp, arrays[n])
    os.replace(tmp, f'{stem}-{n}.npy')
  with open(f'{stem}-description.txt', 'w') as f:
    f.write(text)
  return arrays


def check_vocab(dataset: indexed.IndexedDataset, vocab_size: int, cache_dir: str | None = None):
  """Fails fast when the data was tokenized for another vocabulary than the model's.

  The full scan reads the whole .bin once; with a cache_dir, a pass is remembered per file.
  """
  info = np.iinfo(dataset.dtype) if dataset.dtype.kind in 'iu' else None
  if info is None or info.max < vocab_size - 1:
    raise DataError(
      f'{dataset.prefix} stores {dataset.dtype.name} tokens, which cannot hold the '
      f'ids of a {vocab_size}-token vocabulary (model.vocab_size): it was '
      "preprocessed for another tokenizer. Re-run dlmjax.preprocess with the model's "
      'tokenizer, or set model.vocab_size to the one the data was made with.'
    )
  if info.min >= 0 and info.max < vocab_size:
    return  # every value the dtype can hold is a valid id.
  stat = os.stat(dataset.bin_path)
  key = f'{os.path.abspath(dataset.bin_path)}:{stat.st_size}:{stat.st_mtime_ns}:{vocab_size}'
  marker = cache_dir and os.path.join(
    cache_dir, hashlib.md5(key.encode()).hexdigest() + '-vocab-ok'
  )
  if marker and os.path.exists(marker):
    return
  bad, chunk, tokens = 0, 1 << 26, dataset.tokens
  for start in range(0, len(tokens), chunk):
    part = tokens[start : start + chunk]
    if len(part) and (part.max() >= vocab_size or part.min() < 0):
      bad += int(np.count_nonzero((part < 0) | (part >= vocab_size)))
  if bad:
    raise DataError(
      f'{dataset.prefix} has {bad} token ids outside [0, {vocab_size}), the model '
      'vocabulary (model.vocab_size): it was tokenized with another tokenizer. '
      "Set model.vocab_size to the tokenizer's, or re-run dlmjax.preprocess."
    )
  if marker:
    os.makedirs(cache_dir, exist_ok=True)
    open(marker, 'w').close()


class GPTDataset:
  """Samples of seq_len + 1 tokens (int32) from the given documents of an indexed dataset.

  Args:
    dataset: the indexed dataset.
    documents: ids of the sequences this split may use (a contiguous range in Megatron).
    num_samples: samples wanted (sets the epoch count); None for exactly one epoch. len() may be
      larger: the last epoch is used whole.
    seq_len: S; each sample has S + 1 tokens (inputs and shifted labels).
    seed: seeds the numpy RandomState that shuffles, as Megatron's --seed.
    cache_dir: where the index arrays are cached, if given.
    name: the split, for cache file names and messages.
  """

  def __init__(
    self,
    dataset: indexed.IndexedDataset,
    documents: np.ndarray,
    num_samples: int | None,
    seq_len: int,
    seed: int,
    *,
    cache_dir: str | None = None,
    name: str = 'train',
  ):
    self.dataset, self.seq_len, self.name = dataset, seq_len, name
    documents = np.asarray(documents, np.int32)
    tokens = int(dataset.sequence_lengths[documents].sum(dtype=np.int64))
    if len(documents) == 0 or tokens <= seq_len:
      raise DataError(
        f'the {name} split of {dataset.prefix} holds {len(documents)} sequences and '
        f'{tokens} tokens, too few for one sample of {seq_len + 1} tokens; use more '
        'data, a smaller model.seq_len, or another data.split.'
      )
    stat = os.stat(dataset.idx_path)
    description = dict(
      kind='GPTDataset',
      name=name,
      format=_INDEX_FORMAT,
      prefix=os.path.abspath(dataset.prefix),
      idx_size=stat.st_size,
      idx_mtime_ns=stat.st_mtime_ns,
      documents=hashlib.md5(documents.tobytes()).hexdigest(),
      num_samples=num_samples,
      seq_len=seq_len,
      seed=seed,
      arrays=['document_index', 'sample_index', 'shuffle_index'],
    )

    def build():
      epochs = num_epochs_needed(tokens, num_samples, seq_len)
      separate = separate_final_epoch(tokens, num_samples, seq_len)
      rng = np.random.RandomState(seed)
      document_index = build_document_index(documents, epochs, rng, separate)
      sample_index = build_sample_index(dataset.sequence_lengths, document_index, seq_len)
      total = len(sample_index) - 1
      first = ((epochs - 1) * tokens - 1) // seq_len if separate else total
      return dict(
        document_index=document_index,
        sample_index=sample_index,
        shuffle_index=build_shuffle_index(first, total, rng),
      )

    arrays = cached_arrays(cache_dir, description, build)
    self.document_index = arrays['document_index']
    self.sample_index = arrays['sample_index']
    self.shuffle_index = arrays['shuffle_index']

  def __len__(self) -> int:
    return len(self.sample_index) - 1

  def __getitem__(self, i: int) -> np.ndarray:
    if not 0 <= i < len(self):
      raise IndexError(f'sample {i} out of range for the {self.name} split ({len(self)} samples)')
    j = int(self.shuffle_index[i])
    first, offset, last, end = self.sample_index[j : j + 2].ravel().tolist()
    doc = self.document_index
    if first == last:
      return self.dataset.get(int(doc[first]), offset, end - offset + 1).astype(np.int32)
    parts = [self.dataset.get(int(doc[first]), offset)]
    parts.extend(self.dataset.get(int(doc[k])) for k in range(first + 1, last))
    parts.append(self.dataset.get(int(doc[last]), 0, end + 1))
    return np.concatenate(parts, dtype=np.int32)
