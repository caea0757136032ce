"""After a failed save (a full disk), tensorstore's writes still finishing report `Event loop is
closed` through sys.unraisablehook; checkpoint/orbax_noise.py drops exactly those (docs/faults.md,
Disk full)."""

import asyncio
import sys
import threading
import types

from dlmjax.checkpoint import orbax_noise


def _report(error_from, *args):
  """The unraisable report of an error raised by `error_from`, as a native caller makes it (the
  traceback starts in the called function: no Python frame called it)."""
  try:
    error_from(*args)
  except Exception as e:  # pylint: disable=broad-except
    return types.SimpleNamespace(
      exc_type=type(e),
      exc_value=e,
      exc_traceback=e.__traceback__.tb_next,
      err_msg=None,
      object=None,
    )


def test_only_callbacks_on_the_closed_loop_are_dropped(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)
  loop = asyncio.new_event_loop()
  loop.close()
  closed = _report(loop.call_soon_threadsafe, print)
  assert str(closed.exc_value) == 'Event loop is closed'
  other = _report(int, 'x')
  orbax_noise._quiet_writes_after_the_loop_closed()
  orbax_noise._quiet_writes_after_the_loop_closed()  # once: not a chain of hooks
  sys.unraisablehook(closed)
  sys.unraisablehook(other)
  assert seen == [other]

  # The same error raised from Python code (not a late tensorstore callback) is still reported.
  def from_python():
    raise RuntimeError('Event loop is closed')

  sys.unraisablehook(from_python_report := _report(from_python))
  assert seen == [other, from_python_report]


def test_abandoned_reads_of_a_damaged_step_are_dropped_only_after_a_read_failed(monkeypatch):
  """A failed restore leaves orbax's other reads un-awaited; their `Exception ignored in:
  <coroutine ...>` reports are dropped once a read failed, and never before."""
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)
  monkeypatch.setattr(orbax_noise, 'READ_FAILED', threading.Event())
  orbax_noise._quiet_writes_after_the_loop_closed()

  async def read():
    pass

  coroutine = read()
  abandoned = types.SimpleNamespace(
    exc_type=RuntimeError,
    exc_value=RuntimeError('x'),
    exc_traceback=None,
    err_msg=None,
    object=coroutine,
  )
  sys.unraisablehook(abandoned)
  assert seen == [abandoned]
  orbax_noise.READ_FAILED.set()
  sys.unraisablehook(abandoned)
  other = _report(int, 'x')
  sys.unraisablehook(other)
  assert seen == [abandoned, other]
  coroutine.close()
