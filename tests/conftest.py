"""Test set-up: 8 virtual CPU devices for mesh tests, and tiny configs built from real presets."""

import contextlib
import os
import shutil
import tempfile

# Before JAX initialises its backends. The tests' tiny programs spend their time in compilation:
# LLVM at -O0 without its expensive passes cuts the suite's compile time by about 40% on the
# 2-core machine; XLA:CPU's older elemental fusion emitter in place of its MLIR fusion emitters
# compiles a tiny train step in ~55% of the time again (3.2 -> 1.8 s; step_test.py 44 -> 27 s).
# The HLO passes are unchanged; float results may differ in the last bits. XLA aborts on a flag
# it does not know, and jaxlib 0.11 (the GPU image's) has no fusion-emitter flag: it is set only
# for the jaxlib releases that read it.
_DEVICE_COUNT = '--xla_force_host_platform_device_count'


def _jaxlib_version() -> tuple[int, int]:
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  return tuple(int(p) for p in metadata.version('jaxlib').split('.')[:2])


# XLA:CPU's legacy fusion emitter can be chosen up to jaxlib 0.10 (tests/diffusion/tiny_sampler).
LEGACY_CPU_EMITTER = _jaxlib_version() < (0, 11)
FAST_COMPILE = (
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
  *(('--xla_cpu_use_fusion_emitters=false',) if LEGACY_CPU_EMITTER else ()),
)


def with_test_xla_flags(flags):
  """A user's XLA_FLAGS plus the suite's: 8 host devices (the mesh tests need them, so a user's
  own device count is replaced, never duplicated) and the fast-compile flags the user did not
  set to something else."""
  kept = [f for f in flags.split() if f.split('=')[0] != _DEVICE_COUNT]
  names = {f.split('=')[0] for f in kept}
  kept += [f for f in FAST_COMPILE if f.split('=')[0] not in names]
  return ' '.join([*kept, f'{_DEVICE_COUNT}=8'])


def _share_compilations():
  """One persistent JAX compilation cache for this pytest run: the xdist workers and every
  subprocess a test starts inherit it through the environment, so a program that several tests
  compile alike (the tiny train step of each run that resumes, a re-run on the same config, the
  same model in another test file) compiles once. Created by the first process (the xdist
  controller, or pytest itself without xdist) and removed when it ends; never reused across
  runs, so the suite's timings are those of a fresh clone. A user's own cache directory is kept.
  Returns the directory this process must remove, or None."""
  if os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    return None
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='dlmjax-test-compile-cache-')
  # The tiny programs compile in well under JAX's default 1 s threshold.
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
  return os.environ['JAX_COMPILATION_CACHE_DIR']


_OWN_COMPILE_CACHE = _share_compilations()
os.environ['XLA_FLAGS'] = with_test_xla_flags(os.environ.get('XLA_FLAGS', ''))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Implicit rank promotion (x_B + y_BxT) hides shape bugs: it raises everywhere in the suite,
# subprocesses included (they inherit the variable).
os.environ['JAX_NUMPY_RANK_PROMOTION'] = 'raise'

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_numpy_rank_promotion', 'raise')  # in case JAX was imported already
if os.environ.get('JAX_COMPILATION_CACHE_DIR'):  # in case JAX read its environment already
  jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' in os.environ:
  _seconds = float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', _seconds)
if 'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES' in os.environ:
  _size = int(os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'])
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', _size)


@contextlib.contextmanager
def compile_cache_writes_off():
  """Keeps the programs compiled inside out of the shared persistent cache (it is still read).
  jaxlib's CPU `executable.serialize()`, which every cache write calls, twice segfaulted in CI
  serialising the LLaDA2 MoE train step and took an xdist worker down (the other then hung).
  JAX compares the compile time with its minimum before it serialises (compiler._cache_write),
  the entry size only after, and reads `jax_enable_compilation_cache` once per process: an
  infinite minimum compile time is the switch that skips the serialisation."""
  name = 'jax_persistent_cache_min_compile_time_secs'
  before = getattr(jax.config, name)
  jax.config.update(name, float('inf'))
  try:
    yield
  finally:
    jax.config.update(name, before)


@pytest.fixture
def no_compile_cache_writes():
  """compile_cache_writes_off for a whole test."""
  with compile_cache_writes_off():
    yield


@pytest.fixture(scope='session', autouse=True)
def _suite_programs_are_trusted():
  """On a machine with no OS boundary for the code sandbox (no bubblewrap, or no namespaces), the
  suite's own programs run behind the audit hook alone, as for a user who opted in
  (code_exec.require_boundary); the hostile suite skips there. Yields the real check, or None."""
  from dlmjax.tasks import code_exec  # pylint: disable=import-outside-toplevel

  if code_exec.boundary()[0] is not None:
    yield None
    return
  real = code_exec.require_boundary
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(code_exec, 'require_boundary', lambda allow_unsandboxed=False: real(True))
    yield real


@pytest.fixture(autouse=True)
def _refusal_as_users_see_it(request, monkeypatch, _suite_programs_are_trusted):
  """A test marked refuses_without_boundary gets require_boundary as users do."""
  if _suite_programs_are_trusted and request.node.get_closest_marker('refuses_without_boundary'):
    from dlmjax.tasks import code_exec  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(code_exec, 'require_boundary', _suite_programs_are_trusted)


def pytest_unconfigure(config):
  del config
  if _OWN_COMPILE_CACHE:
    shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


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


def heavy_files_first(items):
  """Test files holding a slow or multiprocess test run first (otherwise in collection order).
  scripts/test.sh hands pytest-xdist whole files (--dist loadscope, so a module-scoped fixture,
  often a training run, is built once, not once per worker); started last, the largest file
  would run alone on one worker while the other idles."""
  heavy = {
    item.nodeid.split('::')[0]
    for item in items
    if 'slow' in item.keywords or 'multiprocess' in item.keywords
  }
  items.sort(key=lambda item: item.nodeid.split('::')[0] not in heavy)


def pytest_collection_modifyitems(config, items):
  del config
  heavy_files_first(items)
  if any(d.platform == 'gpu' for d in jax.devices()):
    return
  skip = pytest.mark.skip(reason='needs an NVIDIA GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip)
