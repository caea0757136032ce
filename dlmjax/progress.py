"""A one-line console progress bar (no dependency) for loops people watch: training steps,
conversion, evaluation. Drawn only on a terminal, so logs and CI output stay clean."""

from __future__ import annotations

import sys
import time


def render(done: int, total: int, *, width: int = 30, prefix: str = '', suffix: str = '') -> str:
  """'prefix [#########.....] done/total suffix' (done is clamped into [0, total])."""
  total = max(total, 1)
  done = min(max(done, 0), total)
  filled = width * done // total
  bar = '#' * filled + '.' * (width - filled)
  return ' '.join(p for p in (prefix, f'[{bar}] {done}/{total}', suffix) if p)


class Bar:
  """Redraws one line in place with `\\r`; `clear()` before printing anything else."""

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
    self._last_draw = 0.0
    self._width = 0
    self._started = time.time()
    self._start_done = None

  def update(self, done: int, suffix: str = '') -> None:
    if not self.enabled:
      return
    now = time.time()
    if self._start_done is None:
      self._start_done, self._started = done, now
    if now - self._last_draw < self._min_interval_s and done < self.total:
      return
    rate = (done - self._start_done) / max(now - self._started, 1e-9)
    if rate > 0:
      suffix = f'{suffix} ETA {int((self.total - done) / rate)}s'.strip()
    line = render(done, self.total, prefix=self.prefix, suffix=suffix)
    self.stream.write('\r' + line + ' ' * max(self._width - len(line), 0))
    self.stream.flush()
    self._width, self._last_draw = len(line), now

  def clear(self) -> None:
    if self.enabled and self._width:
      self.stream.write('\r' + ' ' * self._width + '\r')
      self.stream.flush()
      self._width = 0

  def close(self) -> None:
    self.clear()


def is_tty(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


def track(items, prefix: str, *, total: int | None = None, stream=None):
  """Yields from `items`, drawing a bar of how many were taken (terminal only); the loops of
  conversion, scoring and generation wrap their iterables in it."""
  items = list(items) if total is None and not hasattr(items, '__len__') else items
  bar = Bar(len(items) if total is None else total, prefix, stream=stream)
  try:
    for done, item in enumerate(items, 1):
      yield item
      bar.update(done)
  finally:
    bar.close()
