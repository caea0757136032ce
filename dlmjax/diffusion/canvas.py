"""The sampler's canvas: where each row's prompt and completion lie, and the forwards over it.

The canvas is [pads | whole prompt blocks | prompt rest, completion | ...] (block_grid): rows are
left-padded, pads excluded from attention through segment ids, positions start at 0 at each row's
first real token. Every forward the cache modes run (the whole canvas, a prefix of it, a slice
against kept K/V) comes back as the current block's guided logits: CFG applied, MASK and padded
vocabulary rows forbidden. Built inside the sampler's trace, so its arrays are traced values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def block_grid(model_cfg) -> int:
  """The unit a canvas is aligned to: model.block_size for block-causal models, else 1.

  A block-causal model's blocks count from each row's first real token (SDAR trains them so,
  from the start of every packed sample), but its mask counts them from canvas position 0. So
  each row is left-padded by whole blocks: its whole prompt blocks end at one canvas position,
  the prefill, and the rest of its prompt (fewer than block_size tokens) opens the first decoded
  block, fixed there, as in SDAR's generate.py (reference/families_and_decoding.md 3.3). Every row
  then sees the block grid it was trained on, whatever its batch-mates' lengths.
  """
  return model_cfg.block_size if model_cfg.attention_mask == 'block_causal' else 1


@dataclasses.dataclass(frozen=True)
class Canvas:
  """One decode's layout (static ints and traced arrays) and the forwards the cache modes use."""

  module: object
  sampling: object  # the SamplingConfig
  mask_id: int
  vocab_size: int
  batch: int
  block: int
  # The prompt's whole blocks end here in every row (the server's: where every row's prefix
  # ends); a Python int, except in a server call whose mode needs no static start.
  prefill: int
  num_blocks: int
  length: int
  lead: int  # 1 for a shifted model (Dream): a slice starts one position early (see slice_kv).
  offset_B1: jax.Array  # each row's first real token (its position 0).
  start_B1: jax.Array  # each row's completion starts here.
  blocks_needed: jax.Array  # the blocks some row's gen_length tokens reach.
  prompt_real_BL: jax.Array
  decodable_BL: jax.Array  # the completion's positions.
  segments: jax.Array  # segment ids and positions of the model's rows (CFG: twice the batch).
  positions: jax.Array
  x_BL: jax.Array  # the initial canvas: prompts, MASK, pads.

  @classmethod
  def build(cls, module, prompt_BP, prompt_lengths_B, sampling, *, mask_id, pad_id, vocab_size):
    """generate's canvas: every row's prompt, then MASK to the canvas end."""
    batch, width = prompt_BP.shape
    block, gen = sampling.block_length, sampling.gen_length
    grid = block_grid(module.cfg)
    prefill = width // grid * grid
    num_blocks = -(-(grid - 1 + gen) // block) if grid > 1 else sampling.num_blocks
    length = prefill + num_blocks * block
    lengths_B1 = jnp.asarray(prompt_lengths_B, jnp.int32)[:, None]
    start_B1 = prefill + lengths_B1 % grid
    offset_B1 = start_B1 - lengths_B1  # each row's first real token.
    index_1L = jnp.arange(length)[None]
    real_BL = index_1L >= offset_B1
    prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
    if width:
      source_BL = jnp.clip(index_1L - offset_B1 + (width - lengths_B1), 0, width - 1)
      source_BL = jnp.broadcast_to(source_BL, real_BL.shape)
      prompt_tokens_BL = jnp.take_along_axis(prompt_BP, source_BL, 1)
    else:
      prompt_tokens_BL = jnp.full((batch, length), pad_id, jnp.int32)
    prompt_real_BL = real_BL & (index_1L < start_B1)
    x_BL = jnp.where(prompt_real_BL, prompt_tokens_BL, jnp.where(real_BL, mask_id, pad_id))
    return cls.of_rows(
      module,
      x_BL,
      offset_B1[:, 0],
      start_B1[:, 0],
      jnp.full((batch,), length, jnp.int32),
      sampling,
      prefill=prefill,
      num_blocks=num_blocks,
      blocks_needed=(jnp.max(start_B1) - prefill + gen + block - 1) // block,
      mask_id=mask_id,
      vocab_size=vocab_size,
    )

  @classmethod
  def of_rows(
    cls,
    module,
    x_BL,
    offset_B,
    start_B,
    end_B,
    sampling,
    *,
    prefill,
    num_blocks,
    blocks_needed,
    mask_id,
    vocab_size,
  ):
    """A canvas whose rows lie anywhere in it: row b's tokens are x[b, offset_b:end_b] (pads
    around them), its completion starts at start_b. generate's rows all end at the canvas end;
    the server's rows are placed so that each one's current block starts at one position
    (serve/layout.py), whatever its prompt length and block index."""
    batch, length = x_BL.shape
    index_1L = jnp.arange(length)[None]
    offset_B1, start_B1, end_B1 = (
      jnp.asarray(a, jnp.int32)[:, None] for a in (offset_B, start_B, end_B)
    )
    real_BL = (index_1L >= offset_B1) & (index_1L < end_B1)
    segment_ids_BL = real_BL.astype(jnp.int32)
    positions_BL = jnp.maximum(index_1L - offset_B1, 0)
    if sampling.cfg_scale > 0:  # the conditional rows, then the unconditional ones.
      segment_ids_BL = jnp.concatenate([segment_ids_BL, segment_ids_BL])
      positions_BL = jnp.concatenate([positions_BL, positions_BL])
    return cls(
      module=module,
      sampling=sampling,
      mask_id=mask_id,
      vocab_size=vocab_size,
      batch=batch,
      block=sampling.block_length,
      prefill=prefill,
      num_blocks=num_blocks,
      length=length,
      lead=int(getattr(module.cfg, 'shift_logits', False)),
      offset_B1=offset_B1,
      start_B1=start_B1,
      blocks_needed=blocks_needed,
      prompt_real_BL=real_BL & (index_1L < start_B1),
      decodable_BL=real_BL & (index_1L >= start_B1),
      segments=segment_ids_BL,
      positions=positions_BL,
      x_BL=jnp.asarray(x_BL, jnp.int32),
    )

  def block_start(self, block_index):
    return self.prefill + block_index * self.block

  def window(self, a_BL, start):
    """The block [start, start + block) of a [B, length] array."""
    return jax.lax.dynamic_slice_in_dim(a_BL, start, self.block, axis=1)

  def model_tokens(self, x_BL):
    """The model's rows: the canvas, and with CFG a copy whose prompt is MASK."""
    if self.sampling.cfg_scale <= 0:
      return x_BL
    return jnp.concatenate([x_BL, jnp.where(self.prompt_real_BL, self.mask_id, x_BL)])

  def guided(self, hidden_BQD, start, size=None):
    """float32 logits [B, size, V] (size: default the block) from hidden's row `start`: CFG applied
    (u + (s + 1)(c - u)), the padded vocabulary rows and MASK at -inf (MASK kept with
    mask_in_softmax: the commit rule scores with it and forbids it itself)."""
    module = self.module
    size = self.block if size is None else size
    logits = module.logits(jax.lax.dynamic_slice_in_dim(hidden_BQD, start, size, axis=1))
    if self.sampling.cfg_scale > 0:
      cond, uncond = logits[: self.batch], logits[self.batch :]
      logits = uncond + (self.sampling.cfg_scale + 1) * (cond - uncond)
    vocab_V = jnp.arange(logits.shape[-1])
    allowed_V = vocab_V < self.vocab_size
    if not self.sampling.mask_in_softmax:
      allowed_V = allowed_V & (vocab_V != self.mask_id)
    return jnp.where(allowed_V, logits, -jnp.inf)

  def predictable(self, logits_BKV):
    """guided's logits with MASK at -inf: what a prediction may be."""
    return jnp.where(jnp.arange(logits_BKV.shape[-1]) == self.mask_id, -jnp.inf, logits_BKV)

  def hidden(self, x_BL, view=None):
    """Final hidden states of a forward over x[:view] (default the whole canvas), no cache."""
    view = self.length if view is None else view
    return self.module.hidden(
      self.model_tokens(x_BL)[:, :view],
      segment_ids_BL=self.segments[:, :view],
      positions_BL=self.positions[:, :view],
    )

  def hidden_kv(self, x_BL, view=None):
    """(hidden, every layer's K/V) of a forward over x[:view]: a cache refresh (the whole
    canvas) or the block cache's prefill (the prompt's whole blocks)."""
    view = self.length if view is None else view
    return self.module.hidden_kv(
      self.model_tokens(x_BL)[:, :view],
      positions_BL=self.positions[:, :view],
      segment_ids_BL=self.segments[:, :view],
    )

  def slice_kv(self, x_BL, kv, start, size):
    """(block logits, the slice's fresh K/V, where they start) of the canvas slice [start, start
    + size) against kv, from `lead` positions earlier (a shifted model's predictor of the slice's
    first token, against the same K/V as the rest; none before position 0); the fresh K/V take
    kv's place inside the forward, kv itself is left as it is."""
    total = min(size + self.lead, self.length)
    first = jnp.maximum(start - self.lead, 0)
    hidden, fresh = self.slice_hidden_kv(x_BL, kv, first, total)
    return self.guided(hidden, start - first), fresh, first

  def slice_hidden_kv(self, x_BL, kv, first, size):
    """(hidden, fresh K/V) of the canvas slice [first, first + size) against kv (kv unchanged)."""
    window = lambda a: jax.lax.dynamic_slice_in_dim(a, first, size, axis=1)  # noqa: E731
    return self.module.hidden_kv(
      window(self.model_tokens(x_BL)),
      positions_BL=window(self.positions),
      segment_ids_BL=self.segments,
      kv_cache=kv,
      cache_start=first,
    )
