"""Test set-up: 8 virtual CPU devices for mesh tests, and tiny configs built from real presets."""

import os

# Before JAX initialises its backends. The tests' tiny programs spend their time in compilation:
# LLVM at -O0 without its expensive passes cuts the suite's compile time by about 40% on the
# 2-core machine. The HLO passes are unchanged; float results may differ in the last bits.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8 '
                      '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402



def tiny_test_config(**overrides):
  """configs/tiny.py shrunk further so a step compiles in seconds on 2 cores."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.load_file(os.path.join(os.path.dirname(__file__), '..', 'configs', 'tiny.py'))
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.ffn_dim = 128
  c.model.seq_len = 32
  c.train.global_batch_size = 16
  c.train.micro_batch_size = 8
  c.train.warmup_steps = 2
  c.train.wsd_decay_steps = 2
  c.train.steps = 10
  c.log.every = 1
  return config_lib.apply_overrides(c, overrides)


@pytest.fixture
def tiny_config():
  return tiny_test_config()


def pytest_collection_modifyitems(config, items):
  del config
  if any(d.platform == 'gpu' for d in jax.devices()):
    return
  skip = pytest.mark.skip(reason='needs an NVIDIA GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip)
