"""The serving engine: continuous batching of sampler requests at block boundaries.

Requests (Jobs) wait in a bounded queue and join the decoding set while it has a free slot. One
scheduler thread runs the set chunk by chunk: each round it takes the group of jobs whose chunk
runs the same compiled program (same chunk settings; a seeded stochastic job is a group of its
own), pads their prefixes (prompt + tokens committed so far) into a fixed (batch, width) bucket
and calls the sampler's jitted generate program (sampler.make_generate_fn) once. After the call
every job takes its chunk, may finish (EOS, a stop string, max_tokens) and leaves; the next round
admits waiting jobs into the freed slots. So requests join and leave between blocks and a
request's block b decodes beside other requests' blocks.

A chunk is one block where decoding a block from its prefix alone is exactly the whole-canvas
decode: a causal or block-causal model, whose block cannot see the masked blocks after it (with
block_length on the model's block grid). A bidirectional model's block sees the masks after it,
so its chunk is the whole completion (one call, exactly `python -m dlmjax.generate`'s); such jobs
join and leave at request boundaries. Greedy text is the same either way (tests/serve_test.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import jax
import numpy as np

from dlmjax.diffusion import sampler

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
  """The fixed shapes calls are padded to: batch sizes and prompt widths (ascending)."""

  batch: tuple
  width: tuple

  def pick(self, sizes, value: int, cap: int) -> int:
    for size in sizes:
      if value <= size <= cap:
        return size
    return cap  # the widest prefix the program allows (prompt width + chunk <= seq_len).


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
    self.compiled = set()  # (chunk settings, batch, width) already compiled.
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
          f'batch {b} x width {w}, gen {s.gen_length} steps {s.steps}' for s, b, w in self.compiled
        ),
      }

  # ---- lifecycle ----

  def start(self, warmup: sampler.SamplingConfig | None = None) -> None:
    """Starts the scheduler; with warmup, first compiles that setting's programs for every
    batch bucket at the narrowest width (requests meanwhile get Compiling)."""
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

  def chunk_settings(self, job: Job) -> sampler.SamplingConfig:
    """The program a job's next call runs: one block, or its whole (remaining) completion."""
    s = job.settings
    if self.blockwise(job):
      return dataclasses.replace(s, gen_length=s.block_length, steps=s.steps_per_block)
    return s

  def blockwise(self, job: Job) -> bool:
    """Whether a job decodes one block a call (see the module docstring)."""
    s, cfg = job.settings, self.model.model_config
    if cfg.attention_mask == 'bidirectional' or s.block_length % self.grid:
      return False
    # The last call runs a whole block after the prefix: it must fit in the context.
    keep, done = s.block_length - len(job.prompt) % self.grid, 0
    while done + keep < s.gen_length:
      done, keep = done + keep, s.block_length
    return len(job.prompt) + done + s.block_length <= self.seq_len

  def _keep(self, job: Job) -> int:
    """Tokens of this call a job keeps: up to the end of the block on the model's grid."""
    left = job.settings.gen_length - len(job.tokens)
    if not self.blockwise(job):
      return left
    return min(left, job.settings.block_length - (len(job.prompt) + len(job.tokens)) % self.grid)

  def _group_key(self, job: Job):
    s = self.chunk_settings(job)
    return (s, job.seed if stochastic(s) and job.seed is not None else None)

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

  def _program(self, settings):
    m = self.model.config.model
    return sampler.make_generate_fn(
      self.model.model_config,
      settings,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      vocab_size=m.vocab_size,
    )

  def _shape(self, settings, prefixes) -> tuple[int, int]:
    batch = self.buckets.pick(self.buckets.batch, len(prefixes), self.max_batch)
    cap = self.seq_len - settings.gen_length
    width = self.buckets.pick(self.buckets.width, max(len(p) for p in prefixes), cap)
    return batch, width

  def _call(self, settings, prefixes, seed):
    """int32 [len(prefixes), gen_length]: the chunk of each prefix, in its bucket's shape."""
    batch, width = self._shape(settings, prefixes)
    rows = list(prefixes) + [prefixes[-1]] * (batch - len(prefixes))
    prompt_BP, lengths_B = sampler.pad_prompts(rows, self.pad_id, width)
    if seed is None:
      self._key, key = jax.random.split(self._key)
    else:
      key = jax.random.fold_in(jax.random.key(seed), len(prefixes[0]))
    shape = (settings, batch, width)
    start = time.perf_counter()
    out = self._program(settings)(self.model.params, prompt_BP, lengths_B, key)
    out = np.asarray(jax.device_get(out))
    elapsed = time.perf_counter() - start
    if shape not in self.compiled:
      self.compiled.add(shape)
      log.warning(
        'compiled batch %d x width %d (gen %d, steps %d, block %d, cache %s) in %.1f s',
        batch, width, settings.gen_length, settings.steps, settings.block_length,
        settings.cache, elapsed,
      )  # fmt: skip
    else:
      self.busy_s += elapsed
    self.calls += 1
    self.rows += len(prefixes)
    self.slots += batch
    return out[: len(prefixes), width:]

  def warm(self, settings, widths=None) -> None:
    """Compiles the programs a job with these settings runs: every batch bucket at each width
    (default: the narrowest bucket). Called before traffic: not thread-safe with it."""
    chunk = self.chunk_settings(Job(prompt=[self.pad_id], settings=settings))
    for width in widths or self.buckets.width[:1]:
      for batch in self.buckets.batch:
        if batch <= self.max_batch:
          self._call(chunk, [[self.pad_id] * width] * batch, None)

  def _step(self, group: list) -> None:
    settings, seed = self._group_key(group[0])
    try:
      out = self._call(settings, [j.prompt + j.tokens for j in group], seed)
    except Exception as e:  # pylint: disable=broad-except
      log.exception('a decode call failed')
      with self._lock:
        for job in group:
          job.error = f'the decode failed: {type(e).__name__}: {e}'
          self._finish(job, 'error')
      return
    with self._lock:
      for job, row in zip(group, out):
        reason = self._take(job, row[: self._keep(job)].tolist())
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
