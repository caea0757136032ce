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


def test_a_signal_while_the_program_starts_is_taken_over(tmp_path, capsys):
  """install_early (the first line of python -m dlmjax.train) records a SIGTERM that comes
  before the loop's handler; the run then stops at once, exit 0, and a second one is default."""
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  from tests.conftest import tiny_test_config  # pylint: disable=import-outside-toplevel

  previous = signal.getsignal(signal.SIGTERM)
  try:
    preemption.install_early()
    os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    preemption.install_early()  # (the test process must survive: record again, then take over)
    os.kill(os.getpid(), signal.SIGTERM)
    with preemption.StopRequest() as stop:
      assert stop.signal_name == 'SIGTERM'
      assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the second one is default
    preemption.install_early()
    os.kill(os.getpid(), signal.SIGTERM)
    config = tiny_test_config()
    config.output_dir = str(tmp_path / 'run')
    assert loop.train(config) is None
    assert 'SIGTERM before training started: stopping, nothing to checkpoint' in (
      capsys.readouterr().out
    )
    assert not os.path.exists(tmp_path / 'run')
  finally:
    signal.signal(signal.SIGTERM, previous)
