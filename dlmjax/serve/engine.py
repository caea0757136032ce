"""The serving engine: continuous batching of sampler requests at block boundaries.

Requests (Jobs) wait in a bounded queue and join the decoding set while it has a free slot. One
scheduler thread runs the set block by block: each round it takes the group of jobs whose block
runs the same compiled program (same block settings: jobs that differ only in max_tokens share
one; a seeded stochastic job is a group of its own), lays each job's row out in a fixed (batch,
canvas length) bucket so that every row's current block starts at one position, and calls the
sampler's block program (sampler.make_block_fn: the step generate loops) once. After the call
every job takes its block, may finish (EOS, a stop string, max_tokens) and leaves; the next round
admits waiting jobs into the freed slots. So requests join and leave between blocks and a
request's block b decodes beside other requests' blocks, for every attention kind: a row keeps
what its block attends to in generate's canvas (a bidirectional row its whole completion, the
blocks after the current one still MASK; a causal row only up to the block's end), at the same
positions, pads excluded, so greedy text is generate's (tests/serve_test.py).

The calls are pipelined (JAX's asynchronous dispatch): the next block's call is dispatched before
the current one's tokens are downloaded, its rows that continue taking their last blocks from the
device (carry), so the device works while the host streams, schedules and lays out; a row whose
last block turns out to end its job (EOS, a stop string) is dropped from the next call's output.

A lone group (nothing waiting, no other group ready, none of its jobs at its first block) decodes
up to blocks_per_call blocks in one call (make_block_fn's loop over its blocks, each row to its
own end), so one client pays one host round trip per that many blocks; its blocks are then taken
one by one, each streamed and checked for EOS and stop strings as a block of its own.

Prefix reuse (prefix_cache entries): on a causal or block-causal model with the block cache, the
engine stores on the device the K/V of the longest whole-unit prefix two prompts share (a system
prompt), in a small LRU; a call whose rows all start with a stored prefix places it in each row
and prefills only what follows it (sampler.make_block_fn's reuse_window): exact, since a prefix's
K/V depend only on the tokens before it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import cache_modes, sampler

log = logging.getLogger('dlmjax.serve')


class QueueFull(Exception):
  """The waiting queue holds max_queue jobs; the client should retry later."""


class Compiling(Exception):
  """The start-up compilation is still running; the client should retry later."""


def stochastic(settings: sampler.SamplingConfig) -> bool:
  """Whether the decode draws random numbers (its text depends on the key)."""
  return settings.temperature > 0 or settings.alg_temp > 0 or settings.remasking == 'random'


@dataclasses.dataclass(eq=False)
class Job:
  """One completion: its prompt ids, settings (gen_length = max_tokens), and the decode so far.

  The engine calls on_update(job) from its thread after every chunk (and once when the job
  ends); `tokens` then holds every committed token, `finish_reason` is set when it ended.
  """

  prompt: list
  settings: sampler.SamplingConfig
  seed: int | None = None
  stop: tuple = ()
  on_update: object = None
  tokens: list = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # 'stop' | 'length' | 'cancelled' | 'error'
  error: str | None = None
  text: str = ''
  chunks: int = 0
  inflight: int = 0  # blocks dispatched whose tokens are not taken yet
  cancelled: bool = False
  created: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class Buckets:
  """The fixed shapes calls are padded to: batch sizes and canvas lengths (ascending)."""

  batch: tuple
  width: tuple

  def pick(self, sizes, value: int, cap: int) -> int:
    for size in sizes:
      if value <= size <= cap:
        return size
    return cap


@dataclasses.dataclass
class Call:
  """A dispatched call: its jobs (row order), the blocks each decodes, the device output, its
  (settings, batch, length, static start, prefill window), when it began and was dispatched,
  and whether its shape was compiled."""

  group: list
  blocks: list
  out: object
  shape: tuple
  began: float
  dispatched: float
  compiled: bool


@jax.jit
def _carry(x_BL, last_CW, carried_B, count_B, start):
  """x with each carried row's last blocks (the first count_B[b] tokens of row carried_B[b] of
  the previous call's output, -1 for none) written where the row's prefix ends: the count_B[b]
  tokens before the block start."""
  index_BL = jnp.arange(x_BL.shape[1])[None] - (start - count_B[:, None])
  inside_BL = (index_BL >= 0) & (index_BL < count_B[:, None]) & (carried_B[:, None] >= 0)
  rows_BW = jnp.take(last_CW, jnp.maximum(carried_B, 0), axis=0)
  taken_BL = jnp.take_along_axis(rows_BW, jnp.clip(index_BL, 0, last_CW.shape[1] - 1), axis=1)
  return jnp.where(inside_BL, taken_BL, x_BL)


PREFIX_UNIT = 16  # stored prefixes are whole multiples of this (and of the model's block grid)


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
    self.grid = sampler.block_grid(model.model_config)
    self.stop_ids = {m.eos_token_id} | ({stop_piece} if stop_piece is not None else set())
    self.waiting = collections.deque()
    self.active = []
    self.compiled = set()  # (block settings, batch, length, static start) already compiled.
    self.compiling = False
    self.draining = False
    self.calls = 0
    self.rows = 0  # requests' rows over every call; rows / calls is the batching achieved
    self.slots = 0  # rows of the padded batch buckets those calls ran (slots - rows: padding)
    self.blocks = 0  # blocks those calls decoded (blocks / calls: blocks a call, blocks_per_call)
    self.busy_s = 0.0
    self._device_free = 0.0  # when the device finished the last collected call
    self.cancelled = 0
    self.carried = 0  # rows whose last block the device kept for their next call (pipelining)
    # Prefix reuse: up to prefix_cache stored prefixes (token ids -> K/V on the device), LRU.
    self.prefix_cache = prefix_cache
    self.prefix_unit = math.lcm(PREFIX_UNIT, self.grid)
    self.prefixes = collections.OrderedDict()
    self._recent = collections.deque(maxlen=8)  # recent prompts, to find a shared prefix
    self.prefix_rows = 0  # rows whose prefill started after a stored prefix
    self.prefill_skipped = 0  # canvas positions (over bucket rows) those calls did not prefill
    self._lock = threading.Condition()
    self._stopped = False
    self._key = jax.random.key(0)
    self._thread = threading.Thread(target=self._run, name='dlmjax-serve-engine', daemon=True)

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
      self._lock.notify_all()

  def cancel(self, job: Job) -> None:
    """Stops a job at the next chunk boundary (its client went away)."""
    with self._lock:
      if job.finish_reason is None and not job.cancelled:
        job.cancelled = True
        self._lock.notify_all()

  def stats(self) -> dict:
    with self._lock:
      return {
        'waiting': len(self.waiting),
        'decoding': len(self.active),
        'compiling': self.compiling,
        'draining': self.draining,
        'calls': self.calls,
        'rows': self.rows,
        'slots': self.slots,
        'blocks': self.blocks,
        'busy_s': round(self.busy_s, 3),
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

  def start(self, warmup: sampler.SamplingConfig | None = None) -> None:
    """Starts the scheduler; with warmup, first compiles that setting's programs for a one-token
    prompt (warm; requests meanwhile get Compiling)."""
    self.compiling = warmup is not None
    self._warmup = warmup
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

  def block_settings(self, settings: sampler.SamplingConfig) -> sampler.SamplingConfig:
    """The program every block of a job runs: one block of its settings. Jobs that differ only
    in max_tokens share it (their rows' ends are the program's inputs)."""
    return dataclasses.replace(
      settings, gen_length=settings.block_length, steps=settings.steps_per_block
    )

  def sees_ahead(self, settings) -> bool:
    """Whether a block attends to the masked blocks after it: a bidirectional model, or a
    block-causal one whose blocks end inside the model's blocks. Such a row's canvas keeps its
    whole completion; otherwise it ends with the current block (what follows is invisible)."""
    cfg = self.model.model_config
    return cfg.attention_mask == 'bidirectional' or settings.block_length % self.grid != 0

  def layout(self, job: Job, chunk: int | None = None, blocks: int = 1) -> tuple[int, int]:
    """(prefix, tail) of a job's row at block `chunk` (default: the next one to dispatch),
    decoding `blocks` blocks: the canvas tokens before the block (the prompt's whole model
    blocks and the blocks before it) and from the block on (to the end of generate's canvas if
    the block sees ahead, else the blocks it decodes)."""
    s, grid = job.settings, self.grid
    chunk = self.chunk(job) if chunk is None else chunk
    total = -(-(grid - 1 + s.gen_length) // s.block_length) if grid > 1 else s.num_blocks
    prefix = len(job.prompt) // grid * grid + chunk * s.block_length
    ahead = self.sees_ahead(s)
    return prefix, (total - chunk if ahead else blocks) * s.block_length

  @staticmethod
  def chunk(job: Job) -> int:
    """The block a job's next call decodes."""
    return job.chunks + job.inflight

  def blocks_left(self, job: Job) -> int:
    """The blocks a job's max_tokens still needs after those dispatched (an EOS or stop string
    in a block in flight is seen only once it is taken). The first block keeps the tokens after
    the prompt's last whole model block."""
    s = job.settings
    return -(-(s.gen_length + len(job.prompt) % self.grid) // s.block_length) - self.chunk(job)

  def wants_block(self, job: Job) -> bool:
    return job.inflight == 0 or self.blocks_left(job) > 0

  def call_blocks(self, group: list, ready: list) -> int:
    """How many blocks a group's call decodes: up to blocks_per_call (as many as its jobs still
    need) for a lone group, nothing waiting and no other group ready, whose jobs are all past
    their first block (so a new job's first text comes after one block); else 1, so that a
    waiting job or another group gets the next call."""
    if self.waiting or len(group) < len(ready) or any(self.chunk(j) == 0 for j in group):
      return 1
    return max(1, min(self.blocks_per_call, max(self.blocks_left(j) for j in group)))

  def _group_key(self, job: Job):
    """Jobs of one key run one program together: the block settings, a seeded stochastic job's
    seed, and the phase of its block on the model's grid (non-zero only where blocks end inside
    the model's blocks: the rows' offsets must all sit on the grid)."""
    s = self.block_settings(job.settings)
    seed = job.seed if stochastic(s) and job.seed is not None else None
    return (s, seed, self.layout(job)[0] % self.grid)

  def _run(self) -> None:
    try:
      if self._warmup is not None:
        self.warm(self._warmup)
    finally:
      with self._lock:
        self.compiling = False
    pending = None  # the call dispatched last, its tokens not taken yet
    while True:
      with self._lock:
        self._admit()
        if self._stopped:
          return
        ready = [j for j in self.active if self.wants_block(j)]
        if not ready and pending is None:
          self._lock.wait(timeout=0.5)
          continue
        group = self._next_group(ready) if ready else None
        blocks = self.call_blocks(group, ready) if group else 0
      following = self._dispatch(group, pending, blocks=blocks) if group else None
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
      self._remember(job)

  def _next_group(self, jobs: list) -> list:
    """The jobs sharing the oldest job's program (first come, first served)."""
    oldest = min(jobs, key=lambda j: j.created)
    key = self._group_key(oldest)
    return [j for j in jobs if self._group_key(j) == key][: self.max_batch]

  def _program(self, settings, static_start, reuse_window=None):
    m = self.model.config.model
    return sampler.make_block_fn(
      self.model.model_config,
      settings,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      static_start=static_start,
      vocab_size=m.vocab_size,
      reuse_window=reuse_window,
      max_blocks=self.blocks_per_call,
    )

  def reuses(self, settings) -> bool:
    """Whether rows of these settings can start from a stored prefix: the mode keeps exact K/V
    (the block cache on a causal / block-causal model), no CFG (its unconditional rows' prompts
    are MASK), and the row ends with its block."""
    mode = cache_modes.get(settings.cache)
    return (
      self.prefix_cache > 0
      and mode.reuses_prefix
      and settings.cfg_scale <= 0
      and not self.sees_ahead(settings)
    )

  def _remember(self, job: Job) -> None:
    """Stores the K/V of the longest prefix (whole units, within the prompts' whole model
    blocks) that a new job's prompt shares with a recent one, unless a stored prefix that long
    already covers it (called with the lock held, in the scheduler thread)."""
    if not self.reuses(job.settings):
      return
    prompt, unit = job.prompt, self.prefix_unit
    shared = 0
    for other in self._recent:
      n = min(len(prompt), len(other)) // self.grid * self.grid
      same = next((i for i in range(n) if prompt[i] != other[i]), n)
      shared = max(shared, same // unit * unit)
    self._recent.append(list(prompt))
    if shared < unit or any(len(k) >= shared and self._starts(prompt, k) for k in self.prefixes):
      return
    tokens = tuple(prompt[:shared])
    fn = sampler.make_prefix_fn(self.model.model_config)
    self.prefixes[tokens] = fn(self.model.params, np.asarray([tokens], np.int32))
    while len(self.prefixes) > self.prefix_cache:
      self.prefixes.popitem(last=False)

  @staticmethod
  def _starts(prompt, prefix) -> bool:
    return len(prompt) >= len(prefix) and tuple(prompt[: len(prefix)]) == prefix

  def _stored_prefix(self, group: list, start: int):
    """(token ids, K/V, prefill window) of the longest stored prefix every job of a group starts
    with, if prefilling after it saves work (the window: a power of two, at least each row's
    tokens after the prefix and the prefix unit), else None."""
    if not self.prefixes or not self.reuses(group[0].settings):
      return None
    found = [k for k in self.prefixes if all(self._starts(j.prompt, k) for j in group)]
    if not found:
      return None
    tokens = max(found, key=len)
    need = max(self.layout(j)[0] for j in group) - len(tokens)
    window = max(1 << max(need - 1, 0).bit_length(), self.prefix_unit)  # few programs
    if window >= start:
      return None
    self.prefixes.move_to_end(tokens)
    return tokens, self.prefixes[tokens], window

  def shape(self, group: list, length: int | None = None, blocks: int = 1):
    """(batch, canvas length, block start, the start if the program needs it static) of a
    group's call of `blocks` blocks (length: a bucket at least the group's need). Every row's
    current block starts at one position. A row that sees ahead keeps its tail after the block,
    so the canvas holds the longest prefix plus the longest tail, and the block starts the
    longest tail before its end; else the canvas ends with the call's blocks, on the model's
    grid like every prefix: the same for 1 block and for blocks_per_call (one call of several
    blocks is laid out for blocks_per_call, rows ending with their own last block), so such a
    group's calls run two programs per bucket, not one per count."""
    settings = group[0].settings
    block = settings.block_length
    span = 1 if blocks == 1 else self.blocks_per_call
    prefixes, tails = zip(*(self.layout(j, blocks=span) for j in group))
    batch = self.buckets.pick(self.buckets.batch, len(group), self.max_batch)
    need, widths = max(prefixes) + max(tails), self.buckets.width
    length = length or self.buckets.pick(widths, need, max(widths[-1], need))
    if not self.sees_ahead(settings):
      start = (length - span * block) // self.grid * self.grid
      return batch, start + span * block, start, start
    start = length - max(tails)
    mode = cache_modes.get(settings.cache)
    return batch, length, start, start if mode.static_blocks or mode.prefilled else None

  def _dispatch(self, group: list, pending=None, key=None, shape=None, blocks=1):
    """Dispatches a call of a group decoding up to `blocks` blocks, each job as many as it needs
    (asynchronously: nothing waits for the device): the Call, or None if it failed at once (its
    jobs then end with the error). A job whose last blocks are in `pending` (the call before,
    not taken yet) takes them from the device."""
    settings = self.block_settings(group[0].settings)
    if key is None:
      _, seed, _ = self._group_key(group[0])
      if seed is None:
        self._key, key = jax.random.split(self._key)
      else:
        key = jax.random.key(seed)
    batch, length, start, static = shape or self.shape(group, blocks=blocks)
    mask = self.model.config.model.mask_token_id
    block = settings.block_length
    x_BL = np.full((batch, length), self.pad_id, np.int32)
    bounds = np.zeros((3, batch), np.int32)  # each row's offset, completion start, end
    rows = {id(job): row for row, job in enumerate(pending.group)} if pending else {}
    carried_B = np.full((batch,), -1, np.int32)  # the row of `pending` a row's last blocks are in
    count_B = np.zeros((batch,), np.int32)  # how many tokens of it: its blocks in flight
    counts = [max(1, min(blocks, self.blocks_left(job))) for job in group]
    for row in range(batch):
      job = group[min(row, len(group) - 1)]  # padding rows repeat the last job
      prefix, tail = self.layout(job, blocks=counts[min(row, len(group) - 1)])
      tokens = job.prompt + job.tokens  # without the blocks in flight: carried below
      offset = start - prefix
      x_BL[row, offset : offset + len(tokens)] = tokens
      x_BL[row, offset + len(tokens) : start + tail] = mask
      bounds[:, row] = offset, offset + len(job.prompt), start + tail
      carried_B[row] = rows.get(id(job), -1)
      count_B[row] = job.inflight * block
    stored = self._stored_prefix(group, start) if static is not None else None
    window = None if stored is None else stored[2]
    shape = (settings, batch, length, static, window)
    began = time.perf_counter()
    try:
      if (carried_B >= 0).any():
        x_BL = _carry(x_BL, pending.out, carried_B, count_B, np.int32(start))
      out = self._program(settings, static, window)(
        self.model.params,
        x_BL,
        *bounds,
        np.int32(start),
        key,
        np.int32(self.chunk(group[0])),
        np.int32(max(counts)),
        *(() if stored is None else (stored[1],)),
      )
    except Exception as e:  # pylint: disable=broad-except
      self._fail(group, e)
      return None
    for job, count in zip(group, counts):
      job.inflight += count
    self.carried += int((carried_B[: len(group)] >= 0).sum())
    if stored is not None:
      self.prefix_rows += len(group)
      self.prefill_skipped += batch * (static - window)
    self.calls += 1
    self.rows += len(group)
    self.slots += batch
    self.blocks += max(counts)
    return Call(
      group, counts, out, shape, began, time.perf_counter(), compiled=shape in self.compiled
    )

  def _collect(self, call) -> None:
    """Waits for a dispatched call and gives each of its jobs its blocks one by one, each an
    update of its own (a job that ended before a block, or was cancelled, drops the rest)."""
    out = self._wait(call)
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
          reason = self._take(job, self._kept(job, row[k * block : (k + 1) * block].tolist()))
          if reason:
            self._finish(job, reason)
          elif job.on_update:
            job.on_update(job)

  def _wait(self, call):
    """A call's output (numpy, or None if it failed: its jobs end with the error), accounting
    the device's time: from the later of the call's dispatch and the previous call's end (the
    device runs calls in order) to its end; a first call of its shape logs its compilation."""
    try:
      out = np.asarray(jax.device_get(call.out))
    except Exception as e:  # pylint: disable=broad-except
      self._fail(call.group, e)
      return None
    done = time.perf_counter()
    settings, batch, length, static, window = call.shape
    if call.compiled:
      self.busy_s += done - max(call.dispatched, self._device_free)
    else:
      self.compiled.add(call.shape)
      log.warning(
        'compiled batch %d x length %d%s%s (block %d, steps %d, cache %s, up to %d blocks a '
        'call) in %.1f s',
        batch, length, '' if static is None else f' at {static}',
        '' if window is None else f' after a stored prefix, prefill {window}',
        settings.block_length, settings.steps, settings.cache, self.blocks_per_call,
        done - call.began,
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

  def warm(self, settings, lengths=()) -> None:
    """Compiles the programs jobs with these settings run at every batch bucket: at each canvas
    length of `lengths` (default: a one-token prompt's), for one block and, where the layout
    differs (a row that does not see ahead), for blocks_per_call, and the carry of a continuing
    row's blocks into the next call. A static start (cache prefix on a model that sees ahead)
    varies with the traffic: those compile on first use. Called before traffic: not thread-safe
    with it."""
    job = Job(prompt=[self.pad_id], settings=settings)
    spans = {1} if self.sees_ahead(settings) else {1, self.blocks_per_call}
    width = self.blocks_per_call * settings.block_length
    for batch in self.buckets.batch:
      if batch <= self.max_batch:
        group = [job] * batch
        for length, span in itertools.product(lengths or (self.shape(group)[1],), spans):
          shape = self.shape(group, length, span)
          fits = length >= sum(self.layout(job, blocks=span))
          if fits and not (self.sees_ahead(settings) and shape[3]):
            call = self._dispatch(group, key=self._key, shape=shape, blocks=span)
            job.inflight = 0
            if call is not None and self._wait(call) is not None:
              x_BL, none_B = np.zeros(shape[:2], np.int32), np.full(batch, -1, np.int32)
              out = jax.device_put(np.zeros((batch, width), np.int32))
              _carry(x_BL, out, none_B, np.zeros(batch, np.int32), np.int32(shape[2]))

  def _kept(self, job: Job, window) -> list:
    """The tokens a job keeps of its block's window: the window may open with the end of its
    prompt (a block-causal model's first block), and the last block may run past max_tokens."""
    skip = len(job.prompt) + len(job.tokens) - self.layout(job, job.chunks)[0]
    keep = min(job.settings.gen_length - len(job.tokens), job.settings.block_length - skip)
    return list(window[skip : skip + keep])

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
    if job.on_update:
      job.on_update(job)
    self._lock.notify_all()
