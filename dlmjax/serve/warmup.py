"""The serving engine's warm-up: which calls compile every program a setting's jobs run, and
running them one at a time through the engine's own dispatch and wait (engine.py).

The plan is apart from the scheduling: the engine runs the start-up part before it takes
requests, then the rest one call at a time from its scheduler thread, only while no job waits or
decodes, so a request arriving meanwhile waits for at most the one compilation under way. A prefix
the engine stores later (a system prompt its traffic shares) queues the calls of rows after it, so
the next requests with it find them compiled whatever their length or batch.
"""

from __future__ import annotations

import collections
import itertools
import logging

from dlmjax.serve import job as job_lib

log = logging.getLogger('dlmjax.serve')


class Warmup:
  """An engine's warm-up calls: planned (units), queued, and run; counts them for /health."""

  def __init__(self, eng):
    self.engine = eng
    self.queue = collections.deque()  # calls not run yet: (unit, the stored prefix it runs after)
    self.on = False  # planned: stored prefixes queue their calls too (off: compile on first use)
    self.done = 0
    self.total = 0
    self.startup = 0  # how many of them run before requests are taken
    self._last = None  # the last new-row call, which its continuing row's call carries

  def plan(self, settings) -> None:
    """Queues these settings' calls: first a one-token prompt's canvas (the start-up part), then
    the rest of every width bucket's."""
    first = self.units(settings)
    seen = {_key(u) for u in first}
    rest = [u for u in self.units(settings, self.engine.buckets.width) if _key(u) not in seen]
    self.queue.extend((u, None) for u in first + rest)
    self.total, self.startup, self.on = len(first) + len(rest), len(first), True

  def plan_prefix(self, tokens: tuple, settings) -> None:
    """Queues, if planned, the calls of rows after a newly stored prefix (with the
    settings of the job that stored it) at every batch and width bucket its shortest row fits:
    else each would compile on first use, a stall for every row of that call."""
    if self.on:
      units = self._units(settings, self.engine.buckets.width, [self._after(tokens, 1)])
      self.queue.extend((u, tokens) for u in units)
      self.total += len(units)

  def run(self, settings, lengths=(), prompt: int = 1, prefixed: bool = False) -> None:
    """Compiles the programs jobs with these settings run (units), now: not thread-safe with
    traffic (the engine's own warm-up runs from its scheduler thread)."""
    for unit in self.units(settings, lengths, prompt, prefixed):
      self._run(unit)

  def units(self, settings, lengths=(), prompt: int = 1, prefixed: bool = False) -> list:
    """The calls (group, shape, blocks, carried) that compile the programs jobs with these
    settings run at every batch bucket: at each canvas length of `lengths` (default: a
    `prompt`-token prompt's) that such a prompt's row fits (the shortest prompt and max_tokens
    traffic sends: a longer row never runs a shorter canvas), for one block and, where the
    layout differs (a row that does not see ahead), for blocks_per_call, each for a new row and
    then for a continuing one (carried: its blocks taken from the new row's call), and the
    calls' key split: nothing compiles under the first request. Each again after each stored
    prefix (a system prompt the caller had the engine remember), for rows that start with it;
    `prefixed`: only those, where the caller knows every job starts with a stored prefix (the
    load test's --system-prompt; a server learns its prefixes from traffic, so it cannot), as no
    such job runs the programs of a row without one.
    A static start (cache prefix on a model that sees ahead) varies with the traffic: those
    compile on first use."""
    pad = self.engine.pad_id
    bare = [] if prefixed and self.engine.prefixes else [[pad] * prompt]
    after = [self._after(k, prompt) for k in self.engine.prefixes]
    return self._units(settings, lengths, bare + after)

  def _after(self, prefix, prompt: int) -> list:
    """A `prompt`-token prompt's row after a stored prefix: at least one token beyond it."""
    return [*prefix, *[self.engine.pad_id] * max(prompt - len(prefix), 1)]

  def _units(self, settings, lengths, prompts) -> list:
    """units() for rows of these prompts."""
    eng, layout = self.engine, self.engine.layout
    ahead = layout.sees_ahead(settings)
    spans = {1} if ahead else {1, eng.blocks_per_call}
    units = []
    for tokens, batch in itertools.product(prompts, eng.buckets.batch):
      job = job_lib.Job(prompt=tokens, settings=settings)
      if batch <= eng.max_batch:
        group = [job] * batch
        for length, span in itertools.product(lengths or (layout.shape(group)[1],), spans):
          shape = layout.shape(group, length, span)
          fits = length >= sum(layout.row(job, blocks=span))
          if fits and not (ahead and shape[3]):
            units += [(group, shape, span, False), (group, shape, span, True)]
    return units

  def next(self) -> None:
    """Runs the next queued call, unless it runs after a prefix no longer stored (evicted:
    no row runs it; then it is no more counted)."""
    unit, prefix = self.queue.popleft()
    if prefix is not None and prefix not in self.engine.prefixes:
      self.total -= 1
      return
    self._run(unit)
    self.done += 1

  def next_idle(self) -> None:
    """The next queued call, from the idle scheduler (a failure ends the warm-up, not the
    server: the rest compile on first use); logs when the last is done."""
    try:
      self.next()
    except Exception:  # pylint: disable=broad-except
      log.exception('warm-up stopped; the remaining programs compile on first use')
      self.queue.clear()
      self.on = False
    if not self.queue:
      log.warning(
        'warm-up done: %d of %d calls (the default settings at every width bucket, rows after '
        'each stored prefix; %d while idle)',
        self.done, self.total, self.done - self.startup,
      )  # fmt: skip

  def _run(self, unit) -> None:
    """Runs one warm-up call and waits for it. A continuing row's call carries the blocks of
    its new row's call (kept from the unit before; skipped if that failed): the program then
    takes carry's device array, not numpy, a program of its own where the params are committed
    (a loaded model's)."""
    group, shape, span, carried = unit
    last = self._last
    if carried and (last is None or last.group is not group):
      return
    call = self.engine.dispatch(group, last if carried else None, shape=shape, blocks=span)
    group[0].inflight = 0
    ok = self.engine.wait(call) is not None
    self._last = call if ok and not carried else None


def _key(unit) -> tuple:
  group, shape, span, carried = unit
  return tuple(group[0].prompt), shape, span, carried
