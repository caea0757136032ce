"""Preemption: SIGTERM/SIGINT ask the loop to finish its step, checkpoint and exit cleanly.

Clusters announce preemption with SIGTERM (Ctrl-C sends SIGINT); the handler only records the
request, so the step in flight completes and the checkpoint holds a consistent state. A second
signal of the same kind falls through to the default action (kill, KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_early: dict[str, str | None] = {'signal': None}  # a signal received before StopRequest


def _record_early(signum, frame) -> None:
  del frame
  _early['signal'] = signal.Signals(signum).name
  signal.signal(signum, signal.SIG_DFL)  # a second one acts as default, as under StopRequest


def install_early(signals=SIGNALS) -> None:
  """Records SIGTERM/SIGINT from the first moment of `python -m dlmjax.train` (before JAX and
  the model load, seconds in which the default action would kill the process); StopRequest
  takes the request over."""
  if threading.current_thread() is threading.main_thread():
    for sig in signals:
      signal.signal(sig, _record_early)


class StopRequest:
  """Context manager: installs the handlers (main thread only) and restores the old ones."""

  def __init__(self, signals=SIGNALS):
    self._signals = signals
    self._previous = {}
    self.signal_name: str | None = None

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      for sig in self._signals:
        previous = signal.signal(sig, self._handle)
        self._previous[sig] = signal.SIG_DFL if previous is _record_early else previous
      if _early['signal'] is not None:  # received while the program started
        self.signal_name, _early['signal'] = _early['signal'], None
        received = signal.Signals[self.signal_name]
        signal.signal(received, self._previous[received])  # a second one acts as default
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    # The next identical signal acts as if we had never installed a handler.
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

  def requested(self) -> bool:
    """Whether any process was signalled; every process gets the same answer."""
    return any_process([self.signal_name is not None])[0]


def any_process(flags: list[bool]) -> list[bool]:
  """Each flag OR-ed over the processes, so all take the same decision after the same step.

  With several processes the flags are all-gathered (a tiny host collective each step) instead of
  leaving some processes waiting in the next collective while others stop or save.
  """
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return [bool(f) for f in flags]
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  gathered = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
  return [bool(x) for x in gathered.reshape(-1, len(flags)).any(axis=0)]
