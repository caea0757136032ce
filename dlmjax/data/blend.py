"""Megatron's data blends and splits: which prefixes, in what proportions, and which documents.

A blend string is Megatron's --data-path syntax: "0.7 /p/a 0.3 /p/b" (weight, prefix pairs) or
"/p/a /p/b" (prefixes only). A split string such as "969,30,1" cuts each prefix's sequences into
train/valid/test document ranges (reference section 3.4).
"""

from __future__ import annotations

import math
import re

import numpy as np

from dlmjax.data import gpt_dataset
from dlmjax.data import indexed
from dlmjax.data.errors import DataError

SPLITS = ('train', 'valid', 'test')
_SURPLUS = 1.005  # Megatron over-asks each blended dataset by 0.5% so the blend never runs dry.


def _weight(token: str) -> float | None:
  try:
    return float(token)
  except ValueError:
    return None


def parse_blend(blend: str) -> tuple[list[str], list[float] | None]:
  """(prefixes, normalised weights or None) from Megatron's blend syntax."""
  tokens = blend.split()
  if not tokens:
    raise DataError(
      'no data prefixes given: set data.train_prefixes to "/path/prefix" or '
      '"w1 /path/a w2 /path/b" (Megatron --data-path syntax).'
    )
  weights = [_weight(t) for t in tokens[0::2]]
  if len(tokens) % 2 == 1 or all(w is None for w in weights):
    if any(_weight(t) is not None for t in tokens):
      raise DataError(
        f'blend {blend!r} mixes weights and prefixes: give "w1 prefix1 w2 prefix2 '
        '..." or prefixes only.'
      )
    return tokens, None
  prefixes = tokens[1::2]
  bad = [t for t, w in zip(tokens[0::2], weights) if w is None or not math.isfinite(w) or w < 0]
  if bad or any(_weight(p) is not None for p in prefixes):
    raise DataError(
      f'blend {blend!r}: weights must be finite numbers >= 0 before each prefix '
      f'(bad: {bad or "a number in a prefix position"}).'
    )
  total = sum(weights)
  if total <= 0:
    raise DataError(f'blend {blend!r}: the weights sum to {total}; give at least one positive.')
  # Zero-weight entries are dropped: Megatron's greedy blend would still draw them on ties.
  kept = [(p, w / total) for p, w in zip(prefixes, weights) if w > 0]
  return [p for p, _ in kept], [w for _, w in kept]


def parse_split(split: str) -> list[tuple[float, float] | None]:
  """Normalised [begin, end) fractions per split (None where empty): "969,30,1" -> 3 ranges."""
  try:
    parts = [float(p) for p in re.split(r'[,\s]+', split.strip()) if p]
  except ValueError:
    parts = []
  if (
    not 1 <= len(parts) <= 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0
  ):
    raise DataError(
      f'data.split {split!r} is not up to three non-negative numbers with a '
      'positive sum, e.g. "969,30,1" (train, valid, test).'
    )
  parts += [0.0] * (3 - len(parts))
  total = sum(parts)
  bounds = np.cumsum([0.0] + [p / total for p in parts]).tolist()
  return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def split_documents(num_sequences: int, split: str | None, name: str) -> np.ndarray:
  """The sequence ids of one split: [round(a*N), round(b*N)), as Megatron cuts them."""
  if split is None:
    return np.arange(num_sequences, dtype=np.int32)
  bounds = parse_split(split)[SPLITS.index(name)]
  if bounds is None:
    return np.zeros(0, np.int32)
  begin, end = (int(round(f * float(num_sequences))) for f in bounds)
  return np.arange(begin, end, dtype=np.int32)


def blending_indices(
  weights: list[float], size: int, limits: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Megatron's greedy blend: sample s goes to argmax_i(w_i * max(s, 1) - count_i).

  With limits, dataset i leaves the race once it has given limits[i] samples (Megatron's
  exhaustive blend, used for unweighted blends: size = sum(limits), w_i = limits[i] / size).
  Returns (dataset_index int16, dataset_sample_index int64). Sequential by nature; plain Python
  floats are IEEE doubles, as in helpers.cpp, so ties break the same way (lowest i).
  """
  weights = [float(w) for w in weights]
  counts = [0] * len(weights)
  chosen, sample = [0] * size, [0] * size
  open_ = list(range(len(weights)))
  for s in range(size):
    x = float(max(s, 1))
    best, best_error = -1, -math.inf
    for i in open_:
      error = weights[i] * x - counts[i]
      if error > best_error:
        best, best_error = i, error
    chosen[s], sample[s] = best, counts[best]
    counts[best] += 1
    if limits is not None and counts[best] == limits[best]:
      open_.remove(best)
  return np.array(chosen, np.int16), np.array(sample, np.int64)


class BlendedDataset:
  """Samples drawn from several datasets in fixed proportions, in Megatron's order."""

  def __init__(
    self,
    datasets,
    weights: list[float],
    size: int,
    *,
    limits: list[int] | None = None,
    cache_dir=None,
    name: str = 'train',
  ):
    self.datasets, self.name = datasets, name
    # The blending index depends on nothing but the weights, the size and the limits.
    description = dict(
      kind='BlendedDataset',
      name=name,
      weights=list(weights),
      size=size,
      arrays=['dataset_index', 'dataset_sample_index'],
    )
    if limits is not None:
      description['limits'] = list(limits)
    arrays = gpt_dataset.cached_arrays(
      cache_dir,
      description,
      lambda: dict(zip(description['arrays'], blending_indices(weights, size, limits))),
    )
    self.dataset_index = arrays['dataset_index']
    self.dataset_sample_index = arrays['dataset_sample_index']
    used = np.bincount(self.dataset_index, minlength=len(datasets))
    for i, (d, n) in enumerate(zip(datasets, used)):
      if n > len(d):
        raise DataError(
          f'the {name} blend draws {n} samples from {d.dataset.prefix} (blend entry '
          f'{i}), which has {len(d)}; change the weights or the number of samples.'
        )

  def __len__(self) -> int:
    return len(self.dataset_index)

  def __getitem__(self, i: int) -> np.ndarray:
    if not 0 <= i < len(self):
      raise IndexError(f'sample {i} out of range for the {self.name} blend ({len(self)} samples)')
    return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]


def build_dataset(
  blend: str,
  *,
  split: str | None,
  name: str,
  num_samples: int | None,
  seq_len: int,
  seed: int,
  vocab_size: int | None = None,
  cache_dir: str | None = None,
):
  """The dataset of one split of a blend, as Megatron's BlendedMegatronDatasetBuilder makes it.

  Args:
    blend: Megatron blend syntax.
    split: "969,30,1" to cut each prefix, or None to use every prefix whole (Megatron's
      per-split --train-data-path / --valid-data-path).
    name: 'train', 'valid' or 'test'.
    num_samples: samples wanted (train: steps x global batch); None for one epoch.
    vocab_size: when given, every token must be below it (checked once per prefix).
    cache_dir: where index arrays are cached, if given.

  Returns:
    A GPTDataset (one prefix) or a BlendedDataset; both map an index to int32 [seq_len + 1].
  """
  prefixes, weights = parse_blend(blend)
  sources = []
  for prefix in prefixes:
    source = indexed.IndexedDataset(prefix)
    if vocab_size is not None:
      gpt_dataset.check_vocab(source, vocab_size, cache_dir)
    documents = split_documents(len(source), split, name)
    if len(documents) == 0:
      raise DataError(
        f'the {name} split of {prefix} is empty (data.split {split!r} of '
        f'{len(source)} sequences); give it a share or use more documents.'
      )
    sources.append((source, documents))

  def make(i, samples):
    return gpt_dataset.GPTDataset(
      *sources[i], samples, seq_len, seed, cache_dir=cache_dir, name=name
    )

  if len(prefixes) == 1 and weights is None:
    return make(0, num_samples)
  if weights is None:
    return _unweighted_blend(
      [make(i, None) for i in range(len(sources))], num_samples, cache_dir, name
    )
  if num_samples is None:
    datasets = [make(i, None) for i in range(len(sources))]
    # One pass: as many samples as the scarcest dataset allows at these weights.
    size = int(min(len(d) / w for d, w in zip(datasets, weights) if w > 0))
  else:
    sizes = [int(math.ceil(num_samples * w * _SURPLUS)) for w in weights]
    datasets = [make(i, n) for i, n in enumerate(sizes)]
    size = sum(sizes)
  if len(datasets) == 1:
    return datasets[0]
  return BlendedDataset(datasets, weights, size, cache_dir=cache_dir, name=name)


def _unweighted_blend(datasets, num_samples: int | None, cache_dir, name: str) -> BlendedDataset:
  """Megatron's unweighted blend: one epoch of every prefix, weighted by its sample count.

  megatron-core (BlendedMegatronDatasetBuilder) builds each dataset for one epoch, with no
  surplus; the blend has min(num_samples, total) samples drawn greedily at weights
  len_i / total, or, without num_samples, exactly len_i from each (the exhaustive blend).
  """
  lengths = [len(d) for d in datasets]
  total = sum(lengths)
  weights = [n / total for n in lengths]
  if num_samples is None:
    return BlendedDataset(datasets, weights, total, limits=lengths, cache_dir=cache_dir, name=name)
  if num_samples > total:
    raise DataError(
      f'the unweighted {name} blend holds {total} samples (one epoch of each prefix, as '
      f'Megatron sizes it) but {num_samples} are needed (train.steps x '
      'train.global_batch_size); weight the prefixes ("1 /p/a 1 /p/b") to draw more than one '
      'epoch, or train fewer steps.'
    )
  return BlendedDataset(datasets, weights, num_samples, cache_dir=cache_dir, name=name)
