"""orbax's expected notices, dropped, and its errors, cut to one line.

A restore or `verify` should print one line per problem; orbax and tensorstore log notices that
are true and expected, tracebacks of a failure reported anyway, and errors whose text is a
TensorStore spec's repr. Each filter here drops exactly one such kind of record, nothing more.
"""

from __future__ import annotations

import errno
import inspect
import logging
import re
import sys
import threading

# Set once reading a step's arrays failed: orbax leaves the other reads of that restore
# un-awaited, and each coroutine's collection printed an `Exception ignored in: <coroutine ...>`
# traceback after the one warning. From then on those reports (and only those) are dropped.
READ_FAILED = threading.Event()
_NOISE = re.compile(r'\[(source locations|tensorstore_spec)=.*?\](?= \[|$)')
_STATUS = re.compile(r'[A-Z][A-Z_]+: ')  # absl status codes: NOT_FOUND, DATA_LOSS, ...


def is_disk_full(error: BaseException) -> bool:
  while error is not None:
    if getattr(error, 'errno', None) == errno.ENOSPC or 'No space left on device' in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def one_line(error: BaseException) -> str:
  """The error as one line that names the file and the status: the innermost error of the
  chain (tensorstore's `OUT_OF_RANGE: Error reading "<array>" ... at local file "<dir>"`),
  not orbax's wrapper, whose text is a TensorStore spec's repr."""
  chain = [error]
  while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if len(chain) > 20:
      break
  chosen = next((e for e in reversed(chain) if _STATUS.match(str(e))), chain[-1])
  text = _NOISE.sub('', ' '.join(str(chosen).split())).strip()
  return f'{type(chosen).__name__}: {text[:400]}'


class _DropItemMetadataNotice(logging.Filter):
  """A step's checkpoint metadata lives in the step directory (CheckpointManager writes it
  there), so orbax reading one item's directory on its own (params/) warns that the item has
  none: true, expected, and noise on every restore and `verify`. Exactly those records drop."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Metadata file does not exist')


def quiet_item_metadata_notice() -> None:
  logger = logging.getLogger('absl')
  if not any(isinstance(f, _DropItemMetadataNotice) for f in logger.filters):
    logger.addFilter(_DropItemMetadataNotice())


class _DropDiskFullTracebacks(logging.Filter):
  """orbax logs a failed background write with its traceback before re-raising it; a full disk
  is reported as one error line (DiskFullError), so those records are dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and is_disk_full(record.exc_info[1]))


def quiet_disk_full_tracebacks() -> None:
  for name in ('absl', 'asyncio'):  # orbax's logs; asyncio's "Future exception never retrieved"
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropDiskFullTracebacks) for f in logger.filters):
      logger.addFilter(_DropDiskFullTracebacks())
  _quiet_writes_after_the_loop_closed()


def _quiet_writes_after_the_loop_closed() -> None:
  """When a save fails (a full disk), tensorstore's writes still pending finish after orbax's
  background thread closed its event loop, each reporting `RuntimeError: Event loop is closed`
  from loop.call_soon_threadsafe through sys.unraisablehook: a traceback apiece, printed before
  the run's one error line. Exactly those reports are dropped (installed with the manager: they
  come before the failure reaches the training thread)."""
  previous = sys.unraisablehook
  if getattr(previous, 'dlmjax_quiet', False):
    return

  def hook(unraisable):
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    closed_loop = isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
    if closed_loop and tb is not None and tb.tb_frame.f_code.co_name == 'call_soon_threadsafe':
      return
    if READ_FAILED.is_set() and inspect.iscoroutine(unraisable.object):
      return  # the reads a damaged step's failure abandoned, reported as it is set aside
    previous(unraisable)

  hook.dlmjax_quiet = True
  sys.unraisablehook = hook
