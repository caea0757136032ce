"""GPTDataset index semantics on small hand-computed examples and against a sequential walk."""

import os

import numpy as np
import pytest

from dlmjax.data import gpt_dataset
from dlmjax.data import indexed
from dlmjax.data.errors import DataError


def _sequential_sample_index(lengths, document_index, seq_len):
  """helpers.cpp's build_sample_idx, walked token by token as the reference describes."""
  total = sum(lengths[d] for d in document_index)
  rows, position, offset = [(0, 0)], 0, 0
  for _ in range((total - 1) // seq_len):
    remaining = seq_len + 1
    while remaining:
      size = lengths[document_index[position]] - offset
      remaining -= size
      if remaining <= 0:
        offset += remaining + size - 1
        remaining = 0
      else:
        position, offset = position + 1, 0
    rows.append((position, offset))
  return np.array(rows)


def _write(tmp_path, lengths, dtype=np.uint16):
  """Documents of the given lengths holding consecutive token values 1, 2, 3, ..."""
  prefix = str(tmp_path / 'd')
  values = np.arange(1, sum(lengths) + 1)
  with indexed.IndexedDatasetWriter(prefix, dtype) as writer:
    for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):
      writer.add_document(values[start : start + n])
  return indexed.IndexedDataset(prefix)


def test_sample_index_hand_example():
  # Stream: doc0 = tokens 0-2, doc1 = 3-4, doc2 = 5-8; samples of 3 tokens start every 2.
  got = gpt_dataset.build_sample_index(np.array([3, 2, 4], np.int32), np.array([0, 1, 2]), 2)
  assert got.tolist() == [[0, 0], [0, 2], [1, 1], [2, 1], [2, 3]]


@pytest.mark.parametrize('seed', range(5))
def test_sample_index_matches_the_sequential_walk(seed):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(0, 9, size=20).astype(np.int32)
  lengths[rng.randint(20)] = 0
  document_index = rng.permutation(np.tile(np.arange(20), 3))
  for seq_len in (2, 3, 7):
    expected = _sequential_sample_index(lengths.tolist(), document_index, seq_len)
    got = gpt_dataset.build_sample_index(lengths, document_index, seq_len)
    np.testing.assert_array_equal(got, expected)


def test_epochs_and_separate_final_epoch():
  # T=100, S=10: 25 samples need 251 tokens -> 3 epochs; 19 samples fit in 2, 6 < int(0.8*9).
  assert gpt_dataset.num_epochs_needed(100, 25, 10) == 3
  assert gpt_dataset.separate_final_epoch(100, 25, 10)
  assert not gpt_dataset.separate_final_epoch(100, 27, 10)  # 8 final samples >= 7.
  assert gpt_dataset.num_epochs_needed(100, None, 10) == 1
  assert gpt_dataset.num_epochs_needed(100, 9, 11) == 1  # 9*11 + 1 = 100 tokens.


def test_rng_draws_follow_megatron(tmp_path):
  ds = _write(tmp_path, [5, 3, 7, 2, 6])
  got = gpt_dataset.GPTDataset(ds, np.arange(1, 5), None, 4, seed=1234)
  rng = np.random.RandomState(1234)
  document_index = np.arange(1, 5, dtype=np.int32)
  rng.shuffle(document_index)  # documents first, then samples, from one RandomState.
  shuffle_index = np.arange(len(got), dtype=np.uint32)
  rng.shuffle(shuffle_index)
  np.testing.assert_array_equal(got.document_index, document_index)
  np.testing.assert_array_equal(got.shuffle_index, shuffle_index)
  assert len(got) == (3 + 7 + 2 + 6 - 1) // 4


def test_samples_are_overlapping_windows_of_the_stream(tmp_path):
  lengths = [5, 1, 9, 4, 2, 8]
  ds = _write(tmp_path, lengths)
  got = gpt_dataset.GPTDataset(ds, np.arange(6), num_samples=20, seq_len=4, seed=3)
  stream = np.concatenate([ds[d] for d in got.document_index]).astype(np.int32)
  assert len(got) >= 20 and len(got) == (len(stream) - 1) // 4
  for i in range(len(got)):
    j = got.shuffle_index[i]
    sample = got[i]
    assert sample.dtype == np.int32 and sample.shape == (5,)
    np.testing.assert_array_equal(sample, stream[j * 4 : j * 4 + 5])


def test_separate_final_epoch_shuffles_apart(tmp_path):
  ds = _write(tmp_path, [10] * 10)  # T = 100.
  got = gpt_dataset.GPTDataset(ds, np.arange(10), num_samples=25, seq_len=10, seed=0)
  assert sorted(got.document_index[20:].tolist()) == list(range(10))  # the last epoch alone.
  assert sorted(got.shuffle_index[:19].tolist()) == list(range(19))
  assert sorted(got.shuffle_index[19:].tolist()) == list(range(19, len(got)))


def test_index_cache_round_trip(tmp_path):
  ds = _write(tmp_path, [7, 9, 4])
  cache = str(tmp_path / 'cache')
  first = gpt_dataset.GPTDataset(ds, np.arange(3), 6, 3, seed=1, cache_dir=cache)
  names = sorted(os.listdir(cache))
  assert len(names) == 4 and names[0].endswith('-GPTDataset-train-description.txt')
  again = gpt_dataset.GPTDataset(ds, np.arange(3), 6, 3, seed=1, cache_dir=cache)
  assert isinstance(again.shuffle_index, np.memmap)  # loaded, not rebuilt.
  assert [again[i].tolist() for i in range(len(again))] == [
    first[i].tolist() for i in range(len(first))
  ]


def test_errors(tmp_path):
  ds = _write(tmp_path, [3, 2])
  with pytest.raises(DataError, match=r'valid split .* holds 0 sequences'):
    gpt_dataset.GPTDataset(ds, np.arange(0), None, 2, seed=0, name='valid')
  with pytest.raises(DataError, match='too few for one sample of 6 tokens'):
    gpt_dataset.GPTDataset(ds, np.arange(2), None, 5, seed=0)
  with pytest.raises(DataError, match=r'd has 3 token ids outside \[0, 3\)'):
    gpt_dataset.check_vocab(ds, 3)  # tokens are 1..5.
  gpt_dataset.check_vocab(ds, 6)
  with pytest.raises(DataError, match='uint16 tokens, which cannot hold'):
    gpt_dataset.check_vocab(ds, 70000)
