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
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import jax
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


class Engine:
  """The scheduler thread around a Pretrained model (dlmjax/inference.py)."""

  def __init__(self, model, *, max_batch: int, max_queue: int, buckets: Buckets, stop_piece=None):
    self.model = model
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
    self.busy_s = 0.0
    self.cancelled = 0
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
        'busy_s': round(self.busy_s, 3),
        'cancelled': self.cancelled,
        'compiled': sorted(
          f'batch {b} x length {n}, block {s.block_length} steps {s.steps} cache {s.cache}'
          + ('' if at is None else f' at {at}')
          for s, b, n, at in self.compiled
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

  def layout(self, job: Job) -> tuple[int, int]:
    """(prefix, tail) of a job's row at its current block (job.chunks): the canvas tokens before
    the block (the prompt's whole model blocks and the blocks done) and from the block on (to the
    end of generate's canvas if the block sees ahead, else the block)."""
    s, grid = job.settings, self.grid
    blocks = -(-(grid - 1 + s.gen_length) // s.block_length) if grid > 1 else s.num_blocks
    prefix = len(job.prompt) // grid * grid + job.chunks * s.block_length
    ahead = self.sees_ahead(s)
    return prefix, (blocks - job.chunks) * s.block_length if ahead else s.block_length

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
    while True:
      with self._lock:
        self._admit()
        if self._stopped:
          return
        if not self.active:
          self._lock.wait(timeout=0.5)
          continue
        group = self._next_group()
      self._step(group)

  def _admit(self) -> None:
    for job in [j for j in self.active if j.cancelled]:
      self._finish(job, 'cancelled')
    for job in [j for j in self.waiting if j.cancelled]:
      self.waiting.remove(job)
      self._finish(job, 'cancelled', active=False)
    while self.waiting and len(self.active) < self.max_batch:
      self.active.append(self.waiting.popleft())

  def _next_group(self) -> list:
    """The jobs sharing the oldest active job's program (first come, first served)."""
    oldest = min(self.active, key=lambda j: j.created)
    key = self._group_key(oldest)
    return [j for j in self.active if self._group_key(j) == key][: self.max_batch]

  def _program(self, settings, static_start):
    m = self.model.config.model
    return sampler.make_block_fn(
      self.model.model_config,
      settings,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      static_start=static_start,
      vocab_size=m.vocab_size,
    )

  def shape(self, group: list, length: int | None = None) -> tuple[int, int, int, int | None]:
    """(batch, canvas length, block start, the start if the program needs it static) of a
    group's call (length: a bucket at least the group's need). Every row's current block starts
    at one position. A row that sees ahead keeps its tail after the block, so the canvas holds
    the longest prefix plus the longest tail, and the block starts the longest tail before its
    end; else the canvas ends with the block, on the model's grid like every prefix."""
    settings = group[0].settings
    block = settings.block_length
    prefixes, tails = zip(*(self.layout(j) for j in group))
    batch = self.buckets.pick(self.buckets.batch, len(group), self.max_batch)
    need, widths = max(prefixes) + max(tails), self.buckets.width
    length = length or self.buckets.pick(widths, need, max(widths[-1], need))
    if not self.sees_ahead(settings):
      start = (length - block) // self.grid * self.grid
      return batch, start + block, start, start
    start = length - max(tails)
    mode = cache_modes.get(settings.cache)
    return batch, length, start, start if mode.static_blocks or mode.prefilled else None

  def _call(self, group: list, key, block_index: int, shape=None) -> list:
    """Each job's window of one block call: int32 [len(group), block_length]."""
    settings = self.block_settings(group[0].settings)
    batch, length, start, static = shape or self.shape(group)
    mask = self.model.config.model.mask_token_id
    x_BL = np.full((batch, length), self.pad_id, np.int32)
    bounds = np.zeros((3, batch), np.int32)  # each row's offset, completion start, end
    for row in range(batch):
      job = group[min(row, len(group) - 1)]  # padding rows repeat the last job
      prefix, tail = self.layout(job)
      tokens = job.prompt + job.tokens
      offset = start - prefix
      x_BL[row, offset : offset + len(tokens)] = tokens
      x_BL[row, offset + len(tokens) : start + tail] = mask
      bounds[:, row] = offset, offset + len(job.prompt), start + tail
    shape = (settings, batch, length, static)
    began = time.perf_counter()
    out = self._program(settings, static)(
      self.model.params, x_BL, *bounds, np.int32(start), key, np.int32(block_index)
    )
    out = np.asarray(jax.device_get(out))
    elapsed = time.perf_counter() - began
    if shape not in self.compiled:
      self.compiled.add(shape)
      log.warning(
        'compiled batch %d x length %d%s (block %d, steps %d, cache %s) in %.1f s',
        batch, length, '' if static is None else f' at {static}', settings.block_length,
        settings.steps, settings.cache, elapsed,
      )  # fmt: skip
    else:
      self.busy_s += elapsed
    self.calls += 1
    self.rows += len(group)
    self.slots += batch
    return out[: len(group)]

  def warm(self, settings, lengths=()) -> None:
    """Compiles the programs jobs with these settings run at every batch bucket: at each canvas
    length of `lengths` (default: a one-token prompt's). A static start (cache prefix on a model
    that sees ahead) varies with the traffic: those compile on first use. Called before
    traffic: not thread-safe with it."""
    job = Job(prompt=[self.pad_id], settings=settings)
    for batch in self.buckets.batch:
      if batch <= self.max_batch:
        group = [job] * batch
        for length in lengths or (self.shape(group)[1],):
          shape = self.shape(group, length)
          if length >= sum(self.layout(job)) and not (self.sees_ahead(settings) and shape[3]):
            self._call(group, self._key, 0, shape)

  def _kept(self, job: Job, window) -> list:
    """The tokens a job keeps of its block's window: the window may open with the end of its
    prompt (a block-causal model's first block), and the last block may run past max_tokens."""
    skip = len(job.prompt) + len(job.tokens) - self.layout(job)[0]
    keep = min(job.settings.gen_length - len(job.tokens), job.settings.block_length - skip)
    return list(window[skip : skip + keep])

  def _step(self, group: list) -> None:
    _, seed, _ = self._group_key(group[0])
    if seed is None:
      self._key, key = jax.random.split(self._key)
    else:
      key = jax.random.key(seed)
    try:
      out = self._call(group, key, group[0].chunks)
    except Exception as e:  # pylint: disable=broad-except
      log.exception('a decode call failed')
      with self._lock:
        for job in group:
          job.error = f'the decode failed: {type(e).__name__}: {e}'
          self._finish(job, 'error')
      return
    with self._lock:
      for job, row in zip(group, out):
        reason = self._take(job, self._kept(job, row.tolist()))
        if reason:
          self._finish(job, reason)
        elif job.on_update:
          job.on_update(job)

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
