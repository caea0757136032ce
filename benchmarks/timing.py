"""Timing and error helpers the kernel benchmarks share."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, args, iters, repeats=5):
  """Median over `repeats` of the mean time of `iters` back-to-back calls (queue kept full)."""
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    outs = [compiled(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / iters)
  return 1e3 * float(np.median(times))


def rel_err(got, want, live=None):
  """|got - want| / |want| (L2, float64), optionally over the `live` entries only."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if live is not None:
    got, want = got * live, want * live
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))
