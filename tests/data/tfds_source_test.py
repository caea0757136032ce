"""tensorflow-datasets source: a TFDS split built locally, tokenized, packed and resumable."""

import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.data import indexed
from dlmjax.data import pipeline
from dlmjax.data import tfds_source
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

tfds = pytest.importorskip('tensorflow_datasets')

TEXTS = [
  f'document {i}: ' + 'the quick brown fox jumps over the lazy dog. ' * (i % 5 + 1)
  for i in range(60)
]


class DlmjaxTinyText(tfds.core.GeneratorBasedBuilder):
  """60 short English documents, prepared in array_record format (readable without TF)."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    features = tfds.features.FeaturesDict({'text': tfds.features.Text()})
    return tfds.core.DatasetInfo(builder=self, features=features)

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    for i, text in enumerate(TEXTS):
      yield i, {'text': text}


@pytest.fixture(scope='module')
def tfds_config(tmp_path_factory):
  root = tmp_path_factory.mktemp('tfds')
  DlmjaxTinyText(data_dir=str(root / 'data'), file_format='array_record').download_and_prepare()
  spm = tokenizer_lib.train_sentencepiece(TEXTS, str(root / 'tok'), vocab_size=320)
  c = config_lib.defaults()
  c.data.source = 'tfds:dlmjax_tiny_text:train'
  c.data.tokenizer = spm
  c.data.cache_dir, c.data.prefetch, c.data.packing = str(root / 'cache'), 0, True
  c.model.vocab_size, c.model.seq_len = 320, 32
  c.train.global_batch_size, c.train.micro_batch_size, c.train.steps = 4, 4, 60
  with pytest.MonkeyPatch.context() as patch:  # where TFDS finds prepared datasets
    patch.setenv('TFDS_DATA_DIR', str(root / 'data'))
    yield c


def test_tfds_split_is_tokenized_in_order_with_eod(tfds_config):
  config_lib.validate(tfds_config)
  prefix = tfds_source.ensure_tfds_prefix(tfds_config, tfds_config.data.cache_dir)
  tok = tokenizer_lib.load_tokenizer(tfds_config.data.tokenizer)
  source = tfds.data_source('dlmjax_tiny_text', split='train', data_dir=os.environ['TFDS_DATA_DIR'])
  ds = indexed.IndexedDataset(prefix)
  assert len(ds) == len(TEXTS)
  for i in (0, 17, 59):
    np.testing.assert_array_equal(ds[i], tok.encode(source[i]['text'].decode()) + [tok.eod_id])
  # Cached: a second call reuses the files.
  assert tfds_source.ensure_tfds_prefix(tfds_config, tfds_config.data.cache_dir) == prefix


def test_tfds_batches_are_deterministic_and_resume_exactly(tfds_config):
  first = pipeline.make_batch_iterator(tfds_config)
  batches = [next(first) for _ in range(3)]
  assert batches[0]['tokens'].shape == batches[0]['segment_ids'].shape == (4, 33)
  again = pipeline.make_batch_iterator(tfds_config)
  again.set_state(first.get_state())
  np.testing.assert_array_equal(next(again)['tokens'], next(first)['tokens'])
  fresh = pipeline.make_batch_iterator(tfds_config)
  np.testing.assert_array_equal(next(fresh)['tokens'], batches[0]['tokens'])


def test_bad_tfds_sources(tfds_config):
  config = tfds_config.copy_and_resolve_references()
  config.data.source = 'tfds:lm1b'
  with pytest.raises(config_lib.ConfigError, match='tfds:NAME:SPLIT'):
    config_lib.validate(config)
  config.data.source = 'tfds:no_such_dataset_xyz:train'
  with pytest.raises(DataError, match='cannot open TFDS dataset'):
    pipeline.make_batch_iterator(config)
