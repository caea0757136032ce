"""The grain pipeline: Megatron batch order, process slicing, determinism and exact resume."""

import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.data import indexed
from dlmjax.data import pipeline
from dlmjax.data.errors import DataError


@pytest.fixture
def config(builtin_corpus):
  c = config_lib.defaults()
  c.data.cache_dir = os.path.dirname(os.path.dirname(builtin_corpus.prefix))
  c.data.prefetch = 0
  c.model.seq_len = 32
  c.model.vocab_size = 4096
  c.train.global_batch_size = 8
  c.train.steps = 6
  return c


def _take(iterator, n):
  return [next(iterator)['tokens'] for _ in range(n)]


def test_batches_are_consecutive_samples_in_order(config):
  source = pipeline.make_train_source(config)
  assert len(source) >= 6 * 8
  batches = _take(pipeline.make_batch_iterator(config), 3)
  for k, batch in enumerate(batches):
    assert batch.dtype == np.int32 and batch.shape == (8, 33)
    np.testing.assert_array_equal(batch, np.stack([source[i] for i in range(8 * k, 8 * k + 8)]))
  assert 0 <= batches[0].min() and batches[0].max() < 4096


def test_processes_take_their_rows(config):
  whole = _take(pipeline.make_batch_iterator(config), 2)
  parts = [
    _take(pipeline.make_batch_iterator(config, process_index=p, process_count=4), 2)
    for p in range(4)
  ]
  for k in range(2):
    assert parts[0][k].shape == (2, 33)
    np.testing.assert_array_equal(np.concatenate([part[k] for part in parts]), whole[k])
  with pytest.raises(DataError, match='not divisible by the 3 processes'):
    pipeline.make_batch_iterator(config, process_count=3)


@pytest.mark.parametrize('prefetch', [0, 2])
def test_resume_continues_the_stream_exactly(config, prefetch):
  config.data.prefetch = prefetch
  expected = _take(pipeline.make_batch_iterator(config), 5)
  first = pipeline.make_batch_iterator(config)
  got = _take(first, 2)
  state = first.get_state()
  assert state == {'consumed_samples': 16}
  first.close()
  resumed = pipeline.make_batch_iterator(config)
  resumed.set_state(state)
  got += _take(resumed, 3)
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(a, b)


def test_state_is_portable_across_process_counts(config):
  first = pipeline.make_batch_iterator(config)
  _take(first, 3)
  later = pipeline.make_batch_iterator(config, process_index=1, process_count=2)
  later.set_state(first.get_state())
  np.testing.assert_array_equal(next(later)['tokens'], next(first)['tokens'][4:])


def test_deterministic_and_seeded(config):
  a = _take(pipeline.make_batch_iterator(config), 2)
  b = _take(pipeline.make_batch_iterator(config), 2)
  np.testing.assert_array_equal(a, b)
  config.seed += 1
  assert not np.array_equal(a, _take(pipeline.make_batch_iterator(config), 2))


def test_grain_checkpoint_handler_round_trip(config, tmp_path):
  import grain  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  it = pipeline.make_batch_iterator(config)
  _take(it, 2)
  handler = grain.checkpoint.CheckpointHandler()
  handler.save(epath.Path(tmp_path), args=grain.checkpoint.CheckpointSave(it))
  restored = handler.restore(
    epath.Path(tmp_path),
    args=grain.checkpoint.CheckpointRestore(pipeline.make_batch_iterator(config)),
  )
  np.testing.assert_array_equal(next(restored)['tokens'], next(it)['tokens'])


def test_megatron_source_per_split_prefixes(config, tmp_path):
  prefixes = []
  for name, value in (('train', 5), ('valid', 6)):
    prefixes.append(str(tmp_path / name))
    with indexed.IndexedDatasetWriter(prefixes[-1]) as writer:
      for _ in range(20):
        writer.add_document(np.full(40, value))
  config.data.source = 'megatron'
  config.data.train_prefixes, config.data.valid_prefixes = prefixes
  assert (next(pipeline.make_batch_iterator(config))['tokens'] == 5).all()
  assert (next(pipeline.make_batch_iterator(config, split='valid'))['tokens'] == 6).all()
  with pytest.raises(DataError, match='no test data'):
    pipeline.make_batch_iterator(config, split='test')
  config.model.vocab_size = 6
  with pytest.raises(DataError, match='token ids outside'):
    pipeline.make_batch_iterator(config, split='valid')


def test_worker_processes_give_the_same_stream(config):
  expected = _take(pipeline.make_batch_iterator(config), 3)
  config.data.num_workers = 1
  it = pipeline.make_batch_iterator(config)
  it.set_state({'consumed_samples': 8})
  got = _take(it, 2)
  it.close()
  np.testing.assert_array_equal(got, expected[1:])


def test_document_segment_ids_start_after_each_eod():
  tokens = np.array([[5, 2, 7, 8, 2, 9], [2, 2, 4, 4, 4, 4]])
  np.testing.assert_array_equal(
    pipeline.document_segment_ids(tokens, eod_id=2), [[1, 1, 2, 2, 2, 3], [1, 2, 3, 3, 3, 3]]
  )


def test_packing_adds_segment_ids(tmp_path):
  c = config_lib.defaults()
  c.data.source, c.data.packing = 'megatron', True
  c.data.cache_dir, c.data.prefetch = str(tmp_path / 'cache'), 0
  c.data.train_prefixes = str(tmp_path / 'docs')
  c.model.seq_len, c.train.global_batch_size, c.train.steps = 16, 4, 2
  with indexed.IndexedDatasetWriter(c.data.train_prefixes) as writer:
    for n in range(1, 40):
      writer.add_document(np.append(np.full(n % 7 + 1, 10 + n), c.model.eos_token_id))
  batch = next(pipeline.make_batch_iterator(c))
  assert batch['segment_ids'].shape == batch['tokens'].shape == (4, 17)
  np.testing.assert_array_equal(
    batch['segment_ids'], pipeline.document_segment_ids(batch['tokens'], c.model.eos_token_id)
  )
  assert (batch['segment_ids'][:, -1] > 1).all()  # every 17-token row spans documents.
