"""What a cache mode is: the forward each decoding step runs, and the state it keeps for it.

The sampler's loop (sampler.decode_blocks) is the same for every mode; a mode says how the
current block's logits are made. `init` makes the state carried over the blocks (the block
cache's K/V buffers; None for the others), `step` the block's logits of one step, `store` what a
committed block leaves in the state. A refreshing mode (Fast-dLLM's prefix / dual) runs `refresh`,
a whole-canvas forward whose K/V are the next steps' constant, at each block's first step and
every cache_refresh steps, and `step` against those K/V until the next refresh.
"""

from __future__ import annotations

import typing


class Forward(typing.NamedTuple):
  """A step's forward: the current block's guided logits [B, block, V] and, where the forward
  covered the whole canvas without a cache, its hidden states (else None)."""

  logits: object
  hidden: object = None


class CacheMode:
  """The defaults: no state, no refresh, nothing stored; `step` is each mode's own."""

  name = ''
  description = ''
  static_blocks = False  # the forward's shape depends on the block: the blocks are unrolled.
  refreshing = False  # refresh + cached steps (Fast-dLLM); `step` then gets the refresh's K/V.
  prefilled = False  # init reads the canvas before canvas.prefill into its state.
  reuses_prefix = False  # init can start from a stored prefix's K/V (init's `reused`).

  def check(self, model_cfg, sampling) -> None:
    """Raises ValueError naming the setting to change where the mode cannot serve this model."""

  def init(self, canvas, x_BL, reused=None):
    """The state carried over the blocks. reused (reuses_prefix modes only): (K/V [layers, 1, S,
    K, H] of S tokens every row's prompt starts with, window): the state is then built from those
    K/V, placed at each row's start, and a forward of only the last `window` positions before
    canvas.prefill (a serving engine's shared system prompt: serve/layout.py)."""
    return None

  def refresh(self, canvas, x_BL, start):
    """(Forward, every layer's K/V) of the whole canvas: a refreshing mode's kept K/V."""
    raise NotImplementedError(f'cache {self.name!r} does not refresh')

  def step(self, canvas, x_BL, state, start, static_start) -> Forward:
    """The block [start, start + block)'s Forward; static_start is start as a Python int where
    static_blocks, else None; state is init's (or, refreshing, the refresh's K/V)."""
    raise NotImplementedError

  def store(self, canvas, x_BL, state, start, more_blocks):
    """The state after the block at start is committed (more_blocks: a later block will run)."""
    return state


def check_exact(model_cfg, sampling) -> None:
  """'truncate' and 'block' are exact iff no position up to the block end sees past it, and
  ('block') no committed position's K/V depends on a later block."""
  kind, size, mode = model_cfg.attention_mask, model_cfg.block_size, sampling.cache
  if kind == 'causal':
    return
  if kind == 'block_causal':
    if sampling.block_length % size == 0:
      return  # every decoded block starts on the model's grid (canvas.block_grid).
    raise ValueError(
      f'cache={mode!r} needs block_length ({sampling.block_length}) to be a multiple of '
      f'model.block_size ({size}); set block_length to k * {size}.'
    )
  raise ValueError(
    f'cache={mode!r} is exact only for causal or block_causal models; this one is '
    f"{kind} (every token sees the whole canvas): use cache='none', 'prefix' or 'dual'."
  )
