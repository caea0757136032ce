"""Divergence: a step whose loss or gradient is non-finite, or whose loss jumps by
train.spike_factor over the mean of the last train.spike_window finite losses (Megatron's rerun
machinery checks a loss spike the same way, against a factor of what it saw before).

On a divergence the loop keeps the last good checkpoint out of rotation (RunCheckpoints.pin),
so a diverged run can no longer rotate every good state out; with train.rollback_on_divergence
it restores that checkpoint's arrays and trains on, the step counter and the data position
staying where they are: the batches since the checkpoint, which led to the divergence, are
skipped (docs/faults.md, "Divergence").
"""

from __future__ import annotations

import collections
import math


class DivergenceWatch:
  """Tells the first step of each divergence (a healthy step ends one)."""

  def __init__(self, factor: float, window: int, check_spikes: bool = True):
    self.factor, self.window = factor, window
    self.check_spikes = check_spikes and factor > 0 and window > 0
    self._losses = collections.deque(maxlen=max(window, 1))
    self._in_divergence = False
    self._ignore_through = -1

  def observe(self, step: int, loss: float, skipped: bool) -> str | None:
    """What diverged at `step` when a divergence starts there, else None."""
    if step <= self._ignore_through:
      return None
    reason = None
    if skipped or not math.isfinite(loss):
      reason = f'the loss {loss} or the gradient is not finite'
    elif self.check_spikes and len(self._losses) == self.window:
      mean = sum(self._losses) / len(self._losses)
      if mean > 0 and loss > self.factor * mean:
        reason = (
          f'the loss {loss:.4f} is {loss / mean:.1f}x the mean {mean:.4f} of the last '
          f'{self.window} steps (train.spike_factor={self.factor:g})'
        )
    if reason is None:
      self._losses.append(loss)
      self._in_divergence = False
      return None
    started = not self._in_divergence
    self._in_divergence = True
    return reason if started else None

  def forget(self, through_step: int) -> None:
    """After a rollback: the steps up to this one ran on the discarded state; they neither
    start a divergence nor enter the window."""
    self._ignore_through = through_step
    self._in_divergence = False


def last_good_step(steps, diverged_at: int) -> int | None:
  """The newest checkpoint step a healthy loss has vouched for: the loss of step s + 1 is
  computed on checkpoint s's params, so checkpoint s is good when s + 1 < diverged_at."""
  good = [s for s in steps if s <= diverged_at - 2]
  return max(good) if good else None
