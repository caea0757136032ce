"""The serving engine: continuous batching of sampler requests at block boundaries.

Requests (Jobs) wait in a bounded queue and join the decoding set while it has a free slot. One
scheduler thread runs the set block by block: each round it takes a group of jobs whose block
runs the same compiled program, lays their rows out in a fixed (batch, canvas length) bucket
(layout.py: every row's current block at one position, generate's canvas around it) and calls
the sampler's block program (sampler_programs.make_block_fn: the step generate loops) once.
Which group runs, how many blocks its call decodes (a lone group's several) and the hold for
closed-loop clients' next requests are the scheduling policy (schedule.py).
After the call every job takes its block, may finish (EOS, a stop string, max_tokens) and leaves;
the next round admits waiting jobs into the freed slots. So requests join and leave between
blocks and a request's block b decodes beside other requests' blocks.

The calls are pipelined: the next block's call is dispatched before the current one's tokens are
downloaded, its rows that continue taking their last blocks from the device (layout.carry), so the
device works while the host streams, schedules and lays out; a row whose last block turns out to
end its job (EOS, a stop string) is dropped from the next call's output. Calls are dispatched from
a thread of their own, since dispatch is not always asynchronous: XLA:GPU runs a while loop whose
trip count is data-dependent (the sampler's step and block loops) by reading its predicate on the
host each iteration, so the call returns only once the device is done; from the scheduler's
thread that would hold the current block's tokens until the next call had run.

While idle the scheduler runs the warm-up's calls (warmup.py plans them) through the same
dispatch and wait, one at a time: those planned at start and, for each prefix stored since, the
calls of rows after it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time

import jax
import numpy as np

from dlmjax.diffusion import cache_modes, sampler_programs, sampling_config
from dlmjax.serve import job as job_lib
from dlmjax.serve import layout as layout_lib
from dlmjax.serve import schedule as schedule_lib
from dlmjax.serve import warmup as warmup_lib

# Named where the engine is made and fed (api.py, benchmarks/serve.py, tests).
Buckets, Job = layout_lib.Buckets, job_lib.Job

log = logging.getLogger('dlmjax.serve')


class QueueFull(Exception):
  """The waiting queue holds max_queue jobs; the client should retry later."""


class Compiling(Exception):
  """The start-up compilation is still running; the client should retry later."""


@dataclasses.dataclass
class Call:
  """A dispatched call: its jobs (row order), the blocks each decodes, the future of its launch
  on the dispatch thread (the device output, when the program was called and when that call
  returned), its (settings, batch, length, static start, prefill window), and whether its shape
  was compiled."""

  group: list
  blocks: list
  launch: concurrent.futures.Future
  shape: tuple
  compiled: bool


class Engine:
  """The scheduler thread around a Pretrained model (dlmjax/inference.py)."""

  def __init__(
    self,
    model,
    *,
    max_batch: int,
    max_queue: int,
    buckets: Buckets,
    stop_piece=None,
    prefix_cache: int = 0,
    blocks_per_call: int = 1,
  ):
    if blocks_per_call < 1:
      raise ValueError(f'blocks_per_call={blocks_per_call}: a call decodes at least one block.')
    self.model = model
    self.blocks_per_call = blocks_per_call
    self.max_batch = max_batch
    self.max_queue = max_queue
    self.buckets = buckets
    m = model.config.model
    self.seq_len, self.eos_id, self.pad_id = m.seq_len, m.eos_token_id, m.pad_token_id
    self.layout = layout_lib.Layout(
      model.model_config,
      buckets=buckets,
      max_batch=max_batch,
      blocks_per_call=blocks_per_call,
      pad_id=m.pad_token_id,
      mask_id=m.mask_token_id,
    )
    self.schedule = schedule_lib.Schedule(
      self.layout, max_batch=max_batch, blocks_per_call=blocks_per_call
    )
    self.stop_ids = {m.eos_token_id} | ({stop_piece} if stop_piece is not None else set())
    self.waiting = collections.deque()
    self.active = []
    self.compiled = set()  # (block settings, batch, length, static start) already compiled.
    self.compiling = False
    self.warmup = warmup_lib.Warmup(self)
    self.draining = False
    self.calls = 0
    self.rows = 0  # requests' rows over every call; rows / calls is the batching achieved
    self.slots = 0  # rows of the padded batch buckets those calls ran (slots - rows: padding)
    self.blocks = 0  # blocks those calls decoded (blocks / calls: blocks a call, blocks_per_call)
    self.canvases = collections.Counter()  # calls per (block settings, canvas length) run
    self.busy_s = 0.0
    self.dispatch_s = 0.0  # host time inside the program calls: ~busy_s where dispatch blocks
    self._device_free = 0.0  # when the device finished the last collected call
    self._block_s = 0.0  # the device's seconds a block in the last collected call (compiled)
    self.cancelled = 0
    self.carried = 0  # rows whose last block the device kept for their next call (pipelining)
    self.prefixes = layout_lib.Prefixes(model, self.layout, prefix_cache)
    self.prefix_rows = 0  # rows whose prefill started after a stored prefix
    self.prefill_skipped = 0  # canvas positions (over bucket rows) those calls did not prefill
    self._lock = threading.Condition()
    self._stopped = False
    self._key = jax.random.key(0)
    self._thread = threading.Thread(target=self._run, name='dlmjax-serve-engine', daemon=True)
    self._launcher = concurrent.futures.ThreadPoolExecutor(1, 'dlmjax-serve-dispatch')

  # ---- the request side (any thread) ----

  def check(self, job: Job) -> None:
    """Raises ValueError naming the problem for a job the model cannot decode."""
    job.settings.validate()
    if job.settings.block_add_threshold > 0:
      raise ValueError(
        'block_add_threshold (multi-block decoding) decodes several blocks at once in a loop of '
        'its own; the server decodes block by block. Leave it 0 here, or use python -m '
        'dlmjax.generate --block-add-threshold.'
      )
    cache_modes.get(job.settings.cache).check(self.model.model_config, job.settings)
    total = len(job.prompt) + job.settings.gen_length
    if total > self.seq_len:
      raise ValueError(
        f'the prompt has {len(job.prompt)} tokens; with max_tokens {job.settings.gen_length} '
        f'that is {total}, more than the model context of {self.seq_len} tokens. Shorten the '
        'prompt or max_tokens.'
      )

  def submit(self, job: Job) -> None:
    """Queues a checked job; raises Compiling / QueueFull when it cannot be taken now."""
    with self._lock:
      if self.compiling:
        raise Compiling()
      if self.draining or len(self.waiting) >= self.max_queue:
        raise QueueFull()
      self.waiting.append(job)
      self.schedule.arrived()
      self._lock.notify_all()

  def cancel(self, job: Job) -> None:
    """Stops a job at the next chunk boundary (its client went away)."""
    with self._lock:
      if job.finish_reason is None and not job.cancelled:
        job.cancelled = True
        self._lock.notify_all()

  @property
  def held_s(self) -> float:
    """The scheduler's time holding for closed-loop clients' next requests (schedule.py)."""
    return self.schedule.held_s

  def stats(self) -> dict:
    with self._lock:
      return {
        'waiting': len(self.waiting),
        'decoding': len(self.active),
        'compiling': self.compiling,
        'warmed': self.warmup.done,
        'to_warm': self.warmup.total,
        'draining': self.draining,
        'calls': self.calls,
        'rows': self.rows,
        'slots': self.slots,
        'blocks': self.blocks,
        'busy_s': round(self.busy_s, 3),
        'dispatch_s': round(self.dispatch_s, 3),
        'held_s': round(self.held_s, 3),
        'cancelled': self.cancelled,
        'carried': self.carried,
        'prefixes': len(self.prefixes),
        'prefix_rows': self.prefix_rows,
        'prefill_skipped': self.prefill_skipped,
        'blocks_per_call': self.blocks_per_call,
        'compiled': sorted(
          f'batch {b} x length {n}, block {s.block_length} steps {s.steps} cache {s.cache}'
          + ('' if at is None else f' at {at}')
          + ('' if w is None else f' after a stored prefix, prefill {w}')
          for s, b, n, at, w in self.compiled
        ),
      }

  # ---- lifecycle ----

  def start(self, warmup: sampling_config.SamplingConfig | None = None) -> None:
    """Starts the scheduler; with warmup, first compiles that setting's programs for a one-token
    prompt (warmup.py; requests meanwhile get Compiling), then, only while no job waits or decodes,
    one call at a time, the rest of every width bucket's (a request arriving meanwhile waits
    for at most the one compilation under way), and later the calls of rows after each prefix
    stored (without warmup, none: everything compiles on first use)."""
    self.compiling = warmup is not None
    if warmup is not None:
      self.warmup.plan(warmup)
    self._thread.start()

  def stop_taking(self) -> None:
    """New jobs get QueueFull from now on (a shutdown began); queued ones still run."""
    with self._lock:
      self.draining = True

  def drain(self, timeout: float | None = None) -> bool:
    """Takes no new jobs, lets the queued and decoding ones finish, stops; True if all did."""
    with self._lock:
      self.draining = True
      self._lock.notify_all()
      done = self._lock.wait_for(lambda: not self.waiting and not self.active, timeout)
      self._stopped = True
      self._lock.notify_all()
    self._thread.join(timeout=5)
    return done

  # ---- the scheduler thread ----

  block_settings = staticmethod(schedule_lib.block_settings)  # a job's block's program

  def _run(self) -> None:
    try:
      for _ in range(self.warmup.startup):
        self.warmup.next()
    finally:
      with self._lock:
        self.compiling = False
    pending = None  # the call dispatched last, its tokens not taken yet
    while True:
      with self._lock:
        self._admit()
        if self._stopped:
          self._launcher.shutdown(wait=False)
          return
        ready = [j for j in self.active if self.schedule.wants_block(j)]
        if ready and self.schedule.returning:  # jobs just ended: their clients may be back
          room = not self.draining and len(self.active) < self.max_batch
          self.schedule.hold(self._lock, lambda: self._stopped, room=room)
          if room:
            self._admit()
            ready = [j for j in self.active if self.schedule.wants_block(j)]
        # Idle (no job waits or decodes, nothing in flight): the next warm-up call, if any.
        idle = not ready and pending is None
        if idle and not (self.warmup.queue and not self.draining):
          self._lock.wait(timeout=0.5)
          continue
        group = self.schedule.next_group(ready) if ready else None
        blocks = self.schedule.call_blocks(group, ready, self.waiting) if group else 0
      if idle:
        self.warmup.next_idle()
        continue
      following = self.dispatch(group, pending, blocks=blocks) if group else None
      if pending is not None:
        self._collect(pending)
      pending = following

  def _admit(self) -> None:
    for job in [j for j in self.active if j.cancelled]:
      self._finish(job, 'cancelled')
    for job in [j for j in self.waiting if j.cancelled]:
      self.waiting.remove(job)
      self._finish(job, 'cancelled', active=False)
    while self.waiting and len(self.active) < self.max_batch:
      job = self.waiting.popleft()
      self.active.append(job)
      stored = self.prefixes.remember(job)
      if stored:  # the idle warm-up compiles the programs of rows after it (warmup.py)
        self.warmup.plan_prefix(stored, job.settings)

  def _program(self, settings, static_start, reuse_window=None):
    m = self.model.config.model
    return sampler_programs.make_block_fn(
      self.model.model_config,
      settings,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      static_start=static_start,
      vocab_size=m.vocab_size,
      reuse_window=reuse_window,
      max_blocks=self.blocks_per_call,
      out_rows=self.max_batch,  # carry's input: one program a call shape, not a pair of calls'
    )

  def dispatch(self, group: list, pending=None, shape=None, blocks=1):
    """Dispatches a call of a group decoding up to `blocks` blocks, each job as many as it needs:
    the Call, its launch queued on the dispatch thread (nothing here waits for the device; a
    failed launch ends its jobs with the error when the call is collected). A job whose last
    blocks are in `pending` (the call before, not taken yet) takes them from the device. Also
    the warm-up's, with the `shape` it compiles."""
    settings = self.block_settings(group[0].settings)
    _, seed, _ = self.schedule.group_key(group[0])
    if seed is None:
      self._key, key = jax.random.split(self._key)
    else:
      key = jax.random.key(seed)
    batch, length, start, static = shape or self.layout.shape(group, blocks=blocks)
    counts = [max(1, min(blocks, self.layout.blocks_left(job))) for job in group]
    x_BL, bounds, carried_B, count_B = self.layout.fill(
      group, counts, (batch, length, start), pending.group if pending else None
    )
    program, args, stored = self._inputs(group, (batch, length, start, static), bounds, counts, key)
    shape = (settings, batch, length, static, None if stored is None else stored[2])
    previous = pending.launch if (carried_B >= 0).any() else None

    def launch():
      """(device output, when the call began, when dispatching it returned)."""
      began = time.perf_counter()
      x = x_BL
      if previous is not None:  # launched before this one on this thread: its output exists
        x = layout_lib.carry(x, previous.result()[0], carried_B, count_B, np.int32(start))
      out = program(self.model.params, x, *args)
      return out, began, time.perf_counter()

    for job, count in zip(group, counts):
      job.inflight += count
    self.carried += int((carried_B[: len(group)] >= 0).sum())
    if stored is not None:
      self.prefix_rows += len(group)
      self.prefill_skipped += batch * len(stored[0])
    self.calls += 1
    self.rows += len(group)
    self.slots += batch
    self.blocks += max(counts)
    self.canvases[settings, length] += 1
    return Call(group, counts, self._launcher.submit(launch), shape, shape in self.compiled)

  def _inputs(self, group: list, shape: tuple, bounds, counts: list, key):
    """A group's call's program and its arguments after (params, x_BL), and the stored prefix
    its rows start from (None: none)."""
    settings = self.block_settings(group[0].settings)
    _, length, start, static = shape
    stored = self.prefixes.find(group, length - settings.block_length)
    args = (
      *bounds,
      np.int32(start),
      key,
      np.int32(self.layout.chunk(group[0])),
      np.int32(max(counts)),
      *(() if stored is None else (stored[1],)),
    )
    return self._program(settings, static, None if stored is None else stored[2]), args, stored

  def time_block(self, settings, batch: int, length: int, prompt: list, repeats: int = 3):
    """Best seconds over `repeats` of one block call of `batch` new rows (a `prompt`, these
    settings) at canvas `length`, run directly, not scheduled: the device's cost of a block at
    that batch, with no host work overlapped (the load test's ceiling, benchmarks/serve.py). The
    program is the one traffic runs (warm-up compiled it); no counter moves. Not thread-safe with
    traffic."""
    group = [Job(prompt=list(prompt), settings=settings)] * batch
    shape = self.layout.shape(group, length)
    x_BL, bounds, _, _ = self.layout.fill(group, [1] * batch, shape[:3])
    program, args, _ = self._inputs(group, shape, bounds, [1], self._key)
    best = float('inf')
    for _ in range(repeats):
      began = time.perf_counter()
      jax.block_until_ready(program(self.model.params, x_BL, *args))
      best = min(best, time.perf_counter() - began)
    return best

  def _collect(self, call) -> None:
    """Waits for a dispatched call and gives each of its jobs its blocks one by one, each an
    update of its own (a job that ended before a block, or was cancelled, drops the rest)."""
    out = self.wait(call)
    block = call.group[0].settings.block_length
    with self._lock:
      for job, count, row in zip(call.group, call.blocks, [] if out is None else out):
        job.inflight -= count
        for k in range(count):
          if job.finish_reason is not None:  # it ended (EOS, stop, cancelled) before this block
            break
          if job.cancelled:
            self._finish(job, 'cancelled')
            break
          window = row[k * block : (k + 1) * block].tolist()
          reason = self._take(job, self.layout.kept(job, window))
          if reason:
            self._finish(job, reason)
          elif job.on_update:
            job.on_update(job)

  def wait(self, call):
    """A call's output (numpy, or None if it failed: its jobs end with the error), accounting
    the device's time: from the later of the call's launch and the previous call's end (the
    device runs calls in order) to its end; a first call of its shape logs its compilation."""
    try:
      out, began, returned = call.launch.result()
      out = np.asarray(jax.device_get(out))
    except Exception as e:  # pylint: disable=broad-except
      self._fail(call.group, e)
      return None
    done = time.perf_counter()
    settings, batch, length, static, window = call.shape
    if call.compiled:
      device_s = done - max(began, self._device_free)
      self.busy_s += device_s
      self.dispatch_s += returned - began
      self._block_s = device_s / max(call.blocks)
    else:
      self.compiled.add(call.shape)
      log.warning(
        'compiled batch %d x length %d%s%s (block %d, steps %d, cache %s, up to %d blocks a '
        'call) in %.1f s',
        batch, length, '' if static is None else f' at {static}',
        '' if window is None else f' after a stored prefix, prefill {window}',
        settings.block_length, settings.steps, settings.cache, self.blocks_per_call,
        done - began,
      )  # fmt: skip
    self._device_free = done
    return out

  def _fail(self, group: list, e: Exception) -> None:
    log.exception('a decode call failed')
    with self._lock:
      for job in group:
        if job.finish_reason is None:
          job.error = f'the decode failed: {type(e).__name__}: {e}'
          self._finish(job, 'error')

  def _take(self, job: Job, new: list) -> str | None:
    """Appends a call's kept tokens to a job: the finish reason if it ended, else None."""
    job.chunks += 1
    ends = [i for i, t in enumerate(new) if t in self.stop_ids]
    job.tokens += new[: ends[0]] if ends else new
    reason = 'stop' if ends else 'length' if len(job.tokens) >= job.settings.gen_length else None
    text = self.model.tokenizer.decode(job.tokens)
    cut = min((text.find(s) for s in job.stop if s in text), default=-1)
    if cut >= 0:
      text, reason = text[:cut], 'stop'
    job.text = text
    return reason

  def _finish(self, job: Job, reason: str, active: bool = True) -> None:
    """Called with the lock held."""
    if active and job in self.active:
      self.active.remove(job)
    job.finish_reason = reason
    if reason == 'cancelled':
      self.cancelled += 1
    if reason in ('stop', 'length'):  # its client may send its next request now (closed loop)
      self.schedule.ended(self._block_s)
    if job.on_update:
      job.on_update(job)
    self._lock.notify_all()
