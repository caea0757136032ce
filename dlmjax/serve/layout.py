"""The layout of the serving engine's jobs into one device call (engine.py schedules the calls).

Host arithmetic over each job's position (prompt, committed blocks, blocks in flight), apart
from the scheduler's queue and threads: the fixed (batch, canvas length) buckets; each row's
canvas, laid out so that every row's current block starts at one position and the row keeps what
its block attends to in generate's canvas (a bidirectional row its whole completion, the blocks
after the current one still MASK; a causal row only up to the block's end), at the same
positions, pads excluded, so greedy text is generate's (tests/serve_test.py); the carry of a
continuing row's in-flight blocks from the previous call's output on the device; and the stored
prompt prefixes a call may start from.

Prefix reuse (Prefixes): on a causal or block-causal model with the block cache, the K/V of the
longest whole-unit prefix two prompts share (a system prompt) are kept on the device in a small
LRU; a call whose rows all start with a stored prefix places it in each row and prefills only what
follows it (sampler_programs.make_block_fn's reuse_window): exact, since a prefix's K/V depend
only on the tokens before it.

A job here is the engine's Job: its prompt, settings, tokens, chunks and inflight are read.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import cache_modes, sampler_programs
from dlmjax.diffusion import canvas as canvas_lib

PREFIX_UNIT = 16  # stored prefixes are whole multiples of this (and of the model's block grid)


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


@jax.jit
def carry(x_BL, last_CW, carried_B, count_B, start):
  """x with each carried row's last blocks (the first count_B[b] tokens of row carried_B[b] of
  the previous call's output, -1 for none) written where the row's prefix ends: the count_B[b]
  tokens before the block start. The output has max_batch rows whatever that call's batch, so
  each call shape has one carry program."""
  index_BL = jnp.arange(x_BL.shape[1])[None] - (start - count_B[:, None])
  inside_BL = (index_BL >= 0) & (index_BL < count_B[:, None]) & (carried_B[:, None] >= 0)
  rows_BW = jnp.take(last_CW, jnp.maximum(carried_B, 0), axis=0)
  taken_BL = jnp.take_along_axis(rows_BW, jnp.clip(index_BL, 0, last_CW.shape[1] - 1), axis=1)
  return jnp.where(inside_BL, taken_BL, x_BL)


class Layout:
  """Where each job's row sits in a call's canvas, for one model and the engine's buckets."""

  def __init__(
    self, model_config, *, buckets: Buckets, max_batch: int, blocks_per_call: int, pad_id, mask_id
  ):
    self.model_config = model_config
    self.grid = canvas_lib.block_grid(model_config)
    self.buckets = buckets
    self.max_batch = max_batch
    self.blocks_per_call = blocks_per_call
    self.pad_id, self.mask_id = pad_id, mask_id

  def sees_ahead(self, settings) -> bool:
    """Whether a block attends to the masked blocks after it: a bidirectional model, or a
    block-causal one whose blocks end inside the model's blocks. Such a row's canvas keeps its
    whole completion; otherwise it ends with the current block (what follows is invisible)."""
    return (
      self.model_config.attention_mask == 'bidirectional' or settings.block_length % self.grid != 0
    )

  def row(self, job, chunk: int | None = None, blocks: int = 1) -> tuple[int, int]:
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
  def chunk(job) -> int:
    """The block a job's next call decodes."""
    return job.chunks + job.inflight

  def blocks_left(self, job) -> int:
    """The blocks a job's max_tokens still needs after those dispatched (an EOS or stop string
    in a block in flight is seen only once it is taken). The first block keeps the tokens after
    the prompt's last whole model block."""
    s = job.settings
    return -(-(s.gen_length + len(job.prompt) % self.grid) // s.block_length) - self.chunk(job)

  def shape(self, group: list, length: int | None = None, blocks: int = 1):
    """(batch, canvas length, block start, the start if the program needs it static: a mode
    whose forward's shape depends on the block, sampler_programs.make_block_fn) of a
    group's call of `blocks` blocks (length: a bucket at least the group's need). Every row's
    current block starts at one position. A row that sees ahead keeps its tail after the block,
    so the canvas holds the longest prefix plus the longest tail, and the block starts the
    longest tail before its end; else the canvas ends with the call's blocks, on the model's
    grid like every prefix: the same for 1 block and for blocks_per_call (one call of several
    blocks is laid out for blocks_per_call, rows ending with their own last block), so such a
    group's calls run one program per bucket (two where the start is static), not one per count."""
    settings = group[0].settings
    block = settings.block_length
    span = 1 if blocks == 1 else self.blocks_per_call
    prefixes, tails = zip(*(self.row(j, blocks=span) for j in group))
    batch = self.buckets.pick(self.buckets.batch, len(group), self.max_batch)
    need, widths = max(prefixes) + max(tails), self.buckets.width
    length = length or self.buckets.pick(widths, need, max(widths[-1], need))
    static = cache_modes.get(settings.cache).static_blocks
    if not self.sees_ahead(settings):
      start = (length - span * block) // self.grid * self.grid
      return batch, start + span * block, start, start if static else None
    start = length - max(tails)
    return batch, length, start, start if static else None

  def fill(self, group: list, counts: list, shape: tuple, pending: list | None = None):
    """A call's host inputs for a group decoding counts[i] blocks each, in a call of `shape`:
    the canvas x_BL (each row's prompt and committed tokens before the block start, MASK to its
    end, pads around; padding rows repeat the last job), the bounds (each row's offset,
    completion start, end), and for a job whose last blocks are in `pending` (the jobs of the
    call before, in row order, not taken yet) its row there and the tokens to carry (carry's
    carried_B and count_B)."""
    batch, length, start = shape[:3]
    block = group[0].settings.block_length
    x_BL = np.full((batch, length), self.pad_id, np.int32)
    bounds = np.zeros((3, batch), np.int32)  # each row's offset, completion start, end
    rows = {id(job): row for row, job in enumerate(pending)} if pending else {}
    carried_B = np.full((batch,), -1, np.int32)  # the row of `pending` a row's last blocks are in
    count_B = np.zeros((batch,), np.int32)  # how many tokens of it: its blocks in flight
    for row in range(batch):
      job = group[min(row, len(group) - 1)]
      prefix, tail = self.row(job, blocks=counts[min(row, len(group) - 1)])
      tokens = job.prompt + job.tokens  # without the blocks in flight: carried
      offset = start - prefix
      x_BL[row, offset : offset + len(tokens)] = tokens
      x_BL[row, offset + len(tokens) : start + tail] = self.mask_id
      bounds[:, row] = offset, offset + len(job.prompt), start + tail
      carried_B[row] = rows.get(id(job), -1)
      count_B[row] = job.inflight * block
    return x_BL, bounds, carried_B, count_B

  def kept(self, job, window) -> list:
    """The tokens a job keeps of its block's window: the window may open with the end of its
    prompt (a block-causal model's first block), and the last block may run past max_tokens."""
    skip = len(job.prompt) + len(job.tokens) - self.row(job, job.chunks)[0]
    keep = min(job.settings.gen_length - len(job.tokens), job.settings.block_length - skip)
    return list(window[skip : skip + keep])


class Prefixes(collections.OrderedDict):
  """The stored prompt prefixes: token ids -> the K/V of their forward on the device, least
  recently used first, at most `size` of them."""

  def __init__(self, model, layout: Layout, size: int):
    super().__init__()
    self.model, self.layout, self.size = model, layout, size
    self.unit = math.lcm(PREFIX_UNIT, layout.grid)
    self._recent = collections.deque(maxlen=8)  # recent prompts, to find a shared prefix

  def reuses(self, settings) -> bool:
    """Whether rows of these settings can start from a stored prefix: the mode keeps exact K/V
    (the block cache on a causal / block-causal model), no CFG (its unconditional rows' prompts
    are MASK), and the row ends with its block."""
    mode = cache_modes.get(settings.cache)
    return (
      self.size > 0
      and mode.reuses_prefix
      and settings.cfg_scale <= 0
      and not self.layout.sees_ahead(settings)
    )

  def remember(self, job) -> tuple | None:
    """Stores the K/V of the longest prefix (whole units, within the prompts' whole model
    blocks) that a new job's prompt shares with a recent one, unless a stored prefix that long
    already covers it: its tokens if it stored one, else None."""
    if not self.reuses(job.settings):
      return None
    prompt, unit, grid = job.prompt, self.unit, self.layout.grid
    shared = 0
    for other in self._recent:
      n = min(len(prompt), len(other)) // grid * grid
      same = next((i for i in range(n) if prompt[i] != other[i]), n)
      shared = max(shared, same // unit * unit)
    self._recent.append(list(prompt))
    if shared < unit or any(len(k) >= shared and _starts(prompt, k) for k in self):
      return None
    tokens = tuple(prompt[:shared])
    fn = sampler_programs.make_prefix_fn(self.model.model_config)
    self[tokens] = fn(self.model.params, np.asarray([tokens], np.int32))
    while len(self) > self.size:
      self.popitem(last=False)
    return tokens

  def find(self, group: list, prefill: int):
    """(token ids, K/V, prefill window) of the longest stored prefix every job of a group starts
    with, if any, for a call whose prefill (the block cache's: to the canvas's last block) is
    `prefill` positions. The window is what follows the prefix there: every row's prefix starts
    at or after canvas position 0, so each row's tokens after it lie in the window, and it is
    one length per (canvas length, stored prefix): one program, which warm-up can compile."""
    if not self or not self.reuses(group[0].settings):
      return None
    found = [k for k in self if all(_starts(j.prompt, k) for j in group)]
    tokens = max(found, key=len, default=())
    if not tokens or prefill <= len(tokens):
      return None
    self.move_to_end(tokens)
    return tokens, self[tokens], prefill - len(tokens)


def _starts(prompt, prefix) -> bool:
  return len(prompt) >= len(prefix) and tuple(prompt[: len(prefix)]) == prefix
