"""The serving engine's scheduling policy: which jobs decode together, which group's call runs
next, how many blocks it decodes, and how long the next dispatch holds for closed-loop clients'
next requests. The engine (engine.py) asks it each round and does the rest: admitting,
dispatching, collecting, streaming.

Jobs whose block runs the same compiled program (same block settings: jobs that differ only in
max_tokens share one; a seeded stochastic job is a group of its own) form a group; the oldest
job's group runs next (first come, first served).

A lone group (nothing waiting, no other group ready, none of its jobs at its first block) decodes
up to blocks_per_call blocks in one call (make_block_fn's loop over its blocks, each row to its
own end), so one client pays one host round trip per that many blocks; its blocks are then taken
one by one, each streamed and checked for EOS and stop strings as a block of its own.

Closed-loop clients (each sends its next request when its last one ends) come back between
calls, after the host has taken their last block and the HTTP round trip: a few milliseconds
after the next call was composed. Dispatched at once, that call would leave them out and, where
it is a lone group's several-blocks call, they would decode as a cohort of their own, the two
cohorts alternating at half the rows each for ever. So when jobs end, the next dispatch holds
for their clients' next requests, at most HOLD of a block's device time after they ended (the
device meanwhile runs the call in flight, if any); requests that arrive in time join that call.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from dlmjax.diffusion import sampling_config
from dlmjax.serve import job as job_lib
from dlmjax.serve import layout as layout_lib

# How long, in blocks of device time, the next dispatch holds for the next requests of jobs that
# just ended: a closed-loop client's turn-around is milliseconds, a block tens or hundreds of
# them. Under one block: a request that came back too late for a call waits for all of it, one
# held for clients that never come back waits for half of one.
HOLD = 0.5


def block_settings(settings: sampling_config.SamplingConfig) -> sampling_config.SamplingConfig:
  """The program every block of a job runs: one block of its settings. Jobs that differ only
  in max_tokens share it (their rows' ends are the program's inputs)."""
  return dataclasses.replace(
    settings, gen_length=settings.block_length, steps=settings.steps_per_block
  )


class Schedule:
  """An engine's policy over its layout (layout.py), and the hold's state. Its callers hold the
  engine's lock."""

  def __init__(self, layout: layout_lib.Layout, *, max_batch: int, blocks_per_call: int):
    self.layout = layout
    self.max_batch = max_batch
    self.blocks_per_call = blocks_per_call
    self.returning = 0  # jobs ended whose clients' next requests the next dispatch holds for
    self._hold_until = 0.0  # until when (time.monotonic) it holds for them
    self.held_s = 0.0  # the scheduler's time holding for them

  def wants_block(self, job: job_lib.Job) -> bool:
    return job.inflight == 0 or self.layout.blocks_left(job) > 0

  def call_blocks(self, group: list, ready: list, waiting) -> int:
    """How many blocks a group's call decodes: up to blocks_per_call (as many as its jobs still
    need) for a lone group, nothing waiting and no other group ready, whose jobs are all past
    their first block (so a new job's first text comes after one block); else 1, so that a
    waiting job or another group gets the next call."""
    if waiting or len(group) < len(ready) or any(self.layout.chunk(j) == 0 for j in group):
      return 1
    return max(1, min(self.blocks_per_call, max(self.layout.blocks_left(j) for j in group)))

  def group_key(self, job: job_lib.Job):
    """Jobs of one key run one program together: the block settings, a seeded stochastic job's
    seed, and the phase of its block on the model's grid (non-zero only where blocks end inside
    the model's blocks: the rows' offsets must all sit on the grid)."""
    s = block_settings(job.settings)
    seed = job.seed if job_lib.stochastic(s) and job.seed is not None else None
    return (s, seed, self.layout.row(job)[0] % self.layout.grid)

  def next_group(self, jobs: list) -> list:
    """The jobs sharing the oldest job's program (first come, first served)."""
    oldest = min(jobs, key=lambda j: j.created)
    key = self.group_key(oldest)
    return [j for j in jobs if self.group_key(j) == key][: self.max_batch]

  # ---- the hold for closed-loop clients ----

  def ended(self, block_s: float) -> None:
    """A job ended (EOS, a stop string, max_tokens), the last block taking `block_s` of device
    time: its client may send its next request now (closed loop)."""
    now = time.monotonic()
    self.returning = 1 + (self.returning if now < self._hold_until else 0)
    self._hold_until = now + HOLD * block_s

  def arrived(self) -> None:
    """A request came: perhaps one of those held for."""
    self.returning = max(0, self.returning - 1)

  def hold(self, lock: threading.Condition, stopped, *, room: bool) -> None:
    """With room for them, waits on the lock (held) until every client held for came back,
    `stopped()`, or the hold ends; either way the hold is over: those not back by then are new
    requests when they come."""
    if room:
      began = time.perf_counter()
      lock.wait_for(lambda: not self.returning or stopped(), self._hold_until - time.monotonic())
      self.held_s += time.perf_counter() - began
    self.returning = 0
