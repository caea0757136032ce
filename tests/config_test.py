"""Every shipped config loads and validates; bad configs fail with a message naming the fix."""

import glob
import os

import pytest

from dlmjax import config as config_lib
from tests.conftest import tiny_test_config

ROOT = os.path.join(os.path.dirname(__file__), '..')


def _load(path, arg=None):
  return config_lib.load_file(f'{path}:{arg}' if arg else path)


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))))
def test_shipped_configs_validate(path):
  config = _load(path)
  config_lib.validate(config)
  assert set(config.keys()) == set(config_lib.defaults().keys())


def test_pretrain_1p7b_recipe():
  c = _load(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'))
  assert (c.model.num_layers, c.model.d_model, c.model.ffn_dim, c.model.vocab_size) == (
      28, 2048, 6144, 50289)
  assert config_lib.padded_vocab_size(c) == 50304
  assert (c.train.lr, c.train.min_lr, c.train.warmup_steps, c.train.wsd_decay_steps) == (
      2e-4, 2e-5, 2000, 1000)
  config_lib.validate(_load(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'), 'smoke'))


def test_tiny_batches_fit_every_8_device_mesh():
  c = _load(os.path.join(ROOT, 'configs', 'tiny.py'))
  config_lib.validate(c, num_devices=8)  # the default: fsdp fills the devices
  for data, fsdp, tensor in ((8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)):
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    if c.model.num_heads % tensor == 0:
      config_lib.validate(c, num_devices=8)


@pytest.mark.parametrize('overrides,message', [
    ({'mesh.tensor': 3}, 'not divisible by mesh.tensor=3'),
    ({'mesh.data': 16, 'mesh.fsdp': 1}, 'only 8 exist'),
    ({'mesh.data': 3}, 'cannot fill 8 devices'),
    ({'mesh.data': -1, 'mesh.fsdp': -1}, 'at most one axis'),
    ({'mesh.data': 2, 'mesh.fsdp': 1}, 'uses 2 of 8 devices'),
    ({'train.micro_batch_size': 6}, 'not a multiple of train.micro_batch_size'),
    ({'mesh.data': 8, 'mesh.fsdp': 1, 'train.micro_batch_size': 4,
      'train.global_batch_size': 16},
     'not divisible by the batch-parallel devices'),
    ({'model.attention_mask': 'sideways'}, 'model.attention_mask'),
    ({'model.mask_token_id': 99999}, 'outside the vocabulary'),
    ({'model.attention_backend': 'cudnn', 'model.attention_mask': 'block_causal'}, 'xla'),
    ({'diffusion.objective': 'ar'}, 'attention_mask=causal'),
    ({'data.packing': True, 'model.attention_backend': 'cudnn'}, 'attention_backend=xla'),
])
def test_bad_configs_name_the_fix(overrides, message):
  config = tiny_test_config(**overrides)
  devices = 8
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, num_devices=devices)
