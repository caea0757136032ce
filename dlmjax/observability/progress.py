"""Console progress bars (tqdm) for loops people watch: training steps, conversion, scoring and
generation. Drawn only on a terminal, so logs and CI output stay clean; a bar leaves no line."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Bar:
  """A bar advanced to absolute counts (`update(done)`); `clear()` before printing anything else.

  The bar starts at the first count it is given, so a resumed run's rate and ETA count only the
  steps of this process.
  """

  def __init__(
    self,
    total: int,
    prefix: str = '',
    *,
    stream=None,
    enabled: bool | None = None,
    min_interval_s: float = 0.1,
  ):
    self.total, self.prefix = total, prefix
    self.stream = stream or sys.stderr
    self.enabled = is_tty(self.stream) if enabled is None else enabled
    self._min_interval_s = min_interval_s
    self._bar = None

  def update(self, done: int, suffix: str = '') -> None:
    if not self.enabled:
      return
    if self._bar is None:
      self._bar = tqdm(
        total=self.total,
        initial=done,
        desc=self.prefix or None,
        file=self.stream,
        mininterval=self._min_interval_s,
        leave=False,
        dynamic_ncols=True,
      )
    if suffix:
      self._bar.set_postfix_str(suffix, refresh=False)
    self._bar.update(done - self._bar.n)

  def clear(self) -> None:
    if self._bar is not None:
      self._bar.clear()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def is_tty(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


def track(items, prefix: str, *, total: int | None = None, stream=None):
  """Yields from `items` with a bar of how many were taken (terminal only); the loops of
  conversion, scoring and generation wrap their iterables in it."""
  stream = stream or sys.stderr
  yield from tqdm(
    items, desc=prefix, total=total, file=stream, disable=not is_tty(stream), leave=False
  )
