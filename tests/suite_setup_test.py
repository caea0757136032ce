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
  assert flags.split() == [
    '--xla_dump_to=/tmp/d',
    '--xla_backend_optimization_level=2',
    '--xla_llvm_disable_expensive_passes=true',
    '--xla_force_host_platform_device_count=8',
  ]
  assert conftest.with_test_xla_flags(flags) == flags  # applying twice adds nothing
  assert jax.device_count() == 8


def test_implicit_rank_promotion_raises():
  with pytest.raises(ValueError, match='rank_promotion'):
    jnp.ones(3) + jnp.ones((2, 3))
  assert (jnp.ones(3)[None] + jnp.ones((2, 3))).shape == (2, 3)
