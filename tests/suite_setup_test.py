"""The suite's own set-up (tests/conftest.py): devices, XLA flags, rank promotion."""

import jax
import jax.numpy as jnp
import pytest

from tests import conftest


def test_user_xla_flags_are_kept_and_the_device_count_is_the_suites():
  flags = conftest.with_test_xla_flags(
    '--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2 '
    '--xla_backend_optimization_level=2'
  )
  emitter = ['--xla_cpu_use_fusion_emitters=false'] if conftest.LEGACY_CPU_EMITTER else []
  assert flags.split() == [
    '--xla_dump_to=/tmp/d',
    '--xla_backend_optimization_level=2',
    '--xla_llvm_disable_expensive_passes=true',
    *emitter,
    '--xla_force_host_platform_device_count=8',
  ]
  assert conftest.with_test_xla_flags(flags) == flags  # applying twice adds nothing
  assert jax.device_count() == 8


def test_implicit_rank_promotion_raises():
  with pytest.raises(ValueError, match='rank_promotion'):
    jnp.ones(3) + jnp.ones((2, 3))
  assert (jnp.ones(3)[None] + jnp.ones((2, 3))).shape == (2, 3)


def test_one_persistent_compilation_cache_for_the_run_and_its_subprocesses():
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  directory = os.environ['JAX_COMPILATION_CACHE_DIR']
  assert jax.config.jax_compilation_cache_dir == directory and os.path.isdir(directory)
  jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()  # compiled in well under 1 s
  assert any(name.startswith('jit__lambda') for name in os.listdir(directory))
  child = 'import jax; print(jax.config.jax_compilation_cache_dir)'
  out = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == directory  # inherited through the environment


def test_heavy_files_are_collected_first():
  class Item:
    def __init__(self, nodeid, *keywords):
      self.nodeid, self.keywords = nodeid, set(keywords)

  items = [Item('a_test.py::x'), Item('b_test.py::x'), Item('b_test.py::y', 'slow')]
  items += [Item('c_test.py::x'), Item('d_test.py::x', 'multiprocess')]
  conftest.heavy_files_first(items)
  order = ['b_test.py::x', 'b_test.py::y', 'd_test.py::x', 'a_test.py::x', 'c_test.py::x']
  assert [item.nodeid for item in items] == order


def _cache_entries(prefix):
  import os  # pylint: disable=import-outside-toplevel

  directory = os.environ['JAX_COMPILATION_CACHE_DIR']
  return [name for name in os.listdir(directory) if name.startswith(prefix)]


def test_compile_cache_writes_off_keeps_a_program_out_and_restores_the_threshold():
  def kept_out(x):
    return x * 5 - 2

  def written(x):
    return x * 7 - 2

  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  with conftest.compile_cache_writes_off():
    jax.jit(kept_out)(jnp.arange(3.0)).block_until_ready()
  assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold
  jax.jit(written)(jnp.arange(3.0)).block_until_ready()
  assert not _cache_entries('jit_kept_out') and _cache_entries('jit_written')
