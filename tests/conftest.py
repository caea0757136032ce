"""Test set-up: 8 virtual CPU devices for mesh tests, and tiny configs built from real presets."""

import os

# Before JAX initialises its backends. The tests' tiny programs spend their time in compilation:
# LLVM at -O0 without its expensive passes cuts the suite's compile time by about 40% on the
# 2-core machine. The HLO passes are unchanged; float results may differ in the last bits.
_DEVICE_COUNT = '--xla_force_host_platform_device_count'
_FAST_COMPILE = ('--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true')


def with_test_xla_flags(flags):
  """A user's XLA_FLAGS plus the suite's: 8 host devices (the mesh tests need them, so a user's
  own device count is replaced, never duplicated) and the fast-compile flags the user did not
  set to something else."""
  kept = [f for f in flags.split() if f.split('=')[0] != _DEVICE_COUNT]
  names = {f.split('=')[0] for f in kept}
  kept += [f for f in _FAST_COMPILE if f.split('=')[0] not in names]
  return ' '.join([*kept, f'{_DEVICE_COUNT}=8'])


os.environ['XLA_FLAGS'] = with_test_xla_flags(os.environ.get('XLA_FLAGS', ''))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Implicit rank promotion (x_B + y_BxT) hides shape bugs: it raises everywhere in the suite,
# subprocesses included (they inherit the variable).
os.environ['JAX_NUMPY_RANK_PROMOTION'] = 'raise'

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_numpy_rank_promotion', 'raise')  # in case JAX was imported already


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
