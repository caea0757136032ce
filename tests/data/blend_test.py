"""Blend and split parsing, Megatron's greedy blending index and the dataset builder."""

import numpy as np
import pytest

from dlmjax.data import blend
from dlmjax.data import gpt_dataset
from dlmjax.data import indexed
from dlmjax.data.errors import DataError


def _write(path, num_docs, doc_len, value):
  with indexed.IndexedDatasetWriter(str(path), np.uint16) as writer:
    for _ in range(num_docs):
      writer.add_document(np.full(doc_len, value))
  return str(path)


def test_parse_blend():
  assert blend.parse_blend('/p/a') == (['/p/a'], None)
  assert blend.parse_blend(' /p/a  /p/b ') == (['/p/a', '/p/b'], None)
  prefixes, weights = blend.parse_blend('0.7 /p/a 0.3 /p/b')
  assert prefixes == ['/p/a', '/p/b'] and np.allclose(weights, [0.7, 0.3])
  assert blend.parse_blend('30 /p/a 10 /p/b')[1] == [0.75, 0.25]
  assert blend.parse_blend('0 /p/a 2 /p/b') == (['/p/b'], [1.0])


@pytest.mark.parametrize(
  'spec,message',
  [
    ('', 'no data prefixes'),
    ('0.7 /p/a 0.3', 'mixes weights and prefixes'),
    ('0.7 /p/a x /p/b', r"bad: \['x'\]"),
    ('-1 /p/a 2 /p/b', r"bad: \['-1'\]"),
    ('0 /p/a 0 /p/b', 'sum to 0'),
    ('nan /p/a', 'finite'),
  ],
)
def test_parse_blend_errors(spec, message):
  with pytest.raises(DataError, match=message):
    blend.parse_blend(spec)


def test_split_documents():
  assert [blend.split_documents(1000, '969,30,1', s)[[0, -1]].tolist() for s in blend.SPLITS] == [
    [0, 968],
    [969, 998],
    [999, 999],
  ]
  assert len(blend.split_documents(10, '969, 30, 1', 'test')) == 0  # round(9.99) = round(10).
  assert len(blend.split_documents(10, '1', 'valid')) == 0
  assert len(blend.split_documents(10, None, 'valid')) == 10
  with pytest.raises(DataError, match='data.split'):
    blend.parse_split('a,b')
  with pytest.raises(DataError, match='data.split'):
    blend.parse_split('1,2,3,4')


def test_blending_indices_hand_examples():
  chosen, sample = blend.blending_indices([0.5, 0.5], 4)
  assert chosen.tolist() == [0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1]
  chosen, sample = blend.blending_indices([0.7, 0.3], 10)
  assert chosen.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
  assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
  assert chosen.dtype == np.int16


def test_blended_sizes_and_draws(tmp_path):
  a = _write(tmp_path / 'a', 50, 9, 1)
  b = _write(tmp_path / 'b', 50, 9, 2)
  ds = blend.build_dataset(
    f'0.7 {a} 0.3 {b}', split='969,30,1', name='train', num_samples=100, seq_len=8, seed=1
  )
  assert isinstance(ds, blend.BlendedDataset)
  assert len(ds) == 71 + 31  # ceil(100 * 0.7 * 1.005) + ceil(100 * 0.3 * 1.005).
  firsts = [int(ds[i][0]) for i in range(10)]
  assert firsts == [1, 2, 1, 1, 2, 1, 1, 2, 1, 1]  # each dataset's tokens carry its id.
  assert np.bincount(ds.dataset_index).tolist() == [71, 31]


def _write_numbered(path, num_docs, doc_len, base):
  """Documents whose tokens name the prefix and the document (base + j): samples are traceable."""
  with indexed.IndexedDatasetWriter(str(path), np.uint16) as writer:
    for j in range(num_docs):
      writer.add_document(np.full(doc_len, base + j))
  return str(path)


def test_unweighted_blend_follows_megatron_at_and_around_one_epoch(tmp_path):
  # Megatron's rule (megatron-core BlendedMegatronDatasetBuilder, BlendedDataset): with no
  # weights, each prefix is built as its own one-epoch dataset (no surplus), the blend weights
  # are those datasets' lengths n_i, and the blend has min(num_samples, sum n_i) samples drawn
  # greedily; with no num_samples exactly n_i from each.
  a = _write_numbered(tmp_path / 'a', 5, 9, 100)  # 45 tokens -> (45 - 1) // 8 = 5 samples.
  b = _write_numbered(tmp_path / 'b', 4, 9, 200)  # 36 tokens -> 4 samples.
  kw = dict(split=None, seq_len=8, seed=3)
  alone = [blend.build_dataset(p, name='train', num_samples=None, **kw) for p in (a, b)]
  assert [len(d) for d in alone] == [5, 4]
  # Weights 5/9, 4/9: s=0 and s=1 both use max(s, 1) = 1; then 2, 3, ... (worked by hand).
  order = [0, 1, 0, 1, 0, 1, 0, 1, 0]
  for num_samples, size in [(None, 9), (8, 8), (9, 9)]:
    both = blend.build_dataset(f'{a} {b}', name='train', num_samples=num_samples, **kw)
    assert len(both) == size, num_samples
    assert both.dataset_index.tolist() == order[:size]
    counts = [0, 0]
    for s, i in enumerate(order[:size]):
      # Sample s is the next unused sample of prefix i's own one-epoch dataset.
      np.testing.assert_array_equal(both[s], alone[i][counts[i]])
      counts[i] += 1
  with pytest.raises(DataError, match=r'unweighted train blend holds 9 samples .* 10 are needed'):
    blend.build_dataset(f'{a} {b}', name='train', num_samples=10, **kw)


def test_exhaustive_blend_drops_spent_datasets():
  # Once dataset 0 has given its one sample it leaves the race: without the limit the tie at
  # s=2 (0.5 * 2 - 1 = 0 each) would draw it again.
  assert blend.blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]
  chosen, sample = blend.blending_indices([0.5, 0.5], 4, limits=[1, 3])
  assert chosen.tolist() == [0, 1, 1, 1] and sample.tolist() == [0, 0, 1, 2]


def test_single_prefix_validation_split(tmp_path):
  a = _write(tmp_path / 'a', 40, 9, 1)
  single = blend.build_dataset(
    a, split='969,30,1', name='valid', num_samples=None, seq_len=8, seed=1
  )
  assert isinstance(single, gpt_dataset.GPTDataset) and len(single.document_index) == 1


def test_builder_checks_vocab_and_empty_split(tmp_path):
  a = _write(tmp_path / 'a', 10, 9, 300)
  with pytest.raises(DataError, match=r'a has 90 token ids outside \[0, 256\)'):
    blend.build_dataset(
      a, split=None, name='train', num_samples=4, seq_len=8, seed=1, vocab_size=256
    )
  with pytest.raises(DataError, match=r"test split of .*a is empty \(data.split '99,1'"):
    blend.build_dataset(a, split='99,1', name='test', num_samples=4, seq_len=8, seed=1)
