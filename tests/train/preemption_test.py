"""StopRequest in-process: a signal sets the flag, a second one falls through, exit restores."""

import os
import signal
import threading

import pytest

from dlmjax.train import preemption

pytestmark = pytest.mark.skipif(
  threading.current_thread() is not threading.main_thread(),
  reason='signal handlers can only be installed on the main thread',
)


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_requests_a_stop_and_handlers_are_restored(sig):
  seen = []
  previous = signal.signal(sig, lambda *_: seen.append('outer'))
  try:
    with preemption.StopRequest() as stop:
      assert not stop.requested()
      os.kill(os.getpid(), sig)
      assert stop.requested() and stop.signal_name == signal.Signals(sig).name
      # The second identical signal reaches the handler that was there before (here: 'outer').
      os.kill(os.getpid(), sig)
      assert seen == ['outer']
    os.kill(os.getpid(), sig)
    assert seen == ['outer', 'outer']
  finally:
    signal.signal(sig, previous)
