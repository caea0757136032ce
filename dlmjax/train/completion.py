"""When each dispatched train step finished on its devices, timed on a waiter thread.

The loop reads a step's metrics back only after dispatching the next step, and on a GPU that
dispatch returns near the next step's end (the launch queue is full): a row timed by when its
metrics are read runs a whole step late, and the run's last row, read with nothing behind it,
showed twice the steps' speed (docs/benchmarks.md, Checkpoints). A thread that blocks on each
step's metrics as soon as it is dispatched sees the moment they are ready, whatever dispatch does.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax


def _ready_at(tree) -> float:
  jax.block_until_ready(tree)
  return time.time()


class CompletionTimes:
  """watch(step, metrics) after dispatching a step; pop(step) its completion time (time.time())."""

  def __init__(self):
    # One waiter: steps finish in order, so their waits queue in order behind each other.
    self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='dlmjax-step-end')
    self._pending: dict[int, concurrent.futures.Future] = {}

  def watch(self, step: int, metrics) -> None:
    """Starts timing the step whose outputs include `metrics` (arrays the step never donates)."""
    self._pending[step] = self._waiter.submit(_ready_at, metrics)

  def pop(self, step: int) -> float | None:
    """The step's completion time, waiting for it; None for a step never watched."""
    future = self._pending.pop(step, None)
    return None if future is None else future.result()

  def close(self) -> None:
    self._pending.clear()
    self._waiter.shutdown(wait=True)
