"""'block': SDAR's and BD3LM's block K/V cache, exact for causal and block-causal models. One
forward of the prompt's whole blocks fills the cache (SDAR's prefill), each step runs the current
block against it, and once a block is committed one more forward of it appends its K/V, which
every later block attends to and nothing recomputes.

A prefix's K/V depend only on the tokens before it (on the model's block grid), so a stored
prefix that every row starts with is exact in any row: init places it at each row's first token
and prefills only the positions after it (reused)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion.cache_modes import base
from dlmjax.parallel import rules


class BlockCache(base.CacheMode):
  name = 'block'
  description = 'a K/V cache of the prompt and committed blocks (exact for causal models)'
  prefilled = True
  reuses_prefix = True

  def check(self, model_cfg, sampling):
    base.check_exact(model_cfg, sampling)

  def init(self, canvas, x_BL, reused=None):
    shapes = jax.eval_shape(lambda x: canvas.hidden_kv(x)[1], x_BL)
    kv = tuple(
      rules.constrain(
        jnp.zeros(a.shape, a.dtype), (None, rules.BATCH, None, rules.ATTN_HEADS, None)
      )
      for a in shapes
    )
    # A server call's prefill may be traced (its block start a runtime argument: one program
    # per call shape): prefill then runs to the last block's start, a static length; the K/V
    # past the block start are masked from the block (causal / block-causal attention) and each
    # committed block overwrites its own (store), so every block attends to exact K/V only.
    view = canvas.prefill if isinstance(canvas.prefill, int) else canvas.length - canvas.block
    if not view:
      return kv
    if reused is None:
      prompt_kv = canvas.hidden_kv(x_BL, view)[1]
      return tuple(
        jax.lax.dynamic_update_slice_in_dim(a, new.astype(a.dtype), 0, axis=2)
        for a, new in zip(kv, prompt_kv)
      )
    stored, window = reused
    if canvas.sampling.cfg_scale > 0:
      raise ValueError('a stored prefix holds the conditional rows only: reuse it without CFG.')

    def place(a_LSKH, offset, new_LSKH):  # one row: the stored prefix from its first token
      return jax.lax.dynamic_update_slice_in_dim(a_LSKH, new_LSKH.astype(a_LSKH.dtype), offset, 1)

    kv = tuple(
      jax.vmap(place, in_axes=(1, 0, None), out_axes=1)(a, canvas.offset_B1[:, 0], new[:, 0])
      for a, new in zip(kv, stored)
    )
    first = view - window  # every row's tokens after its stored prefix are past this
    _, fresh = canvas.slice_hidden_kv(x_BL, kv, first, window)
    return tuple(
      jax.lax.dynamic_update_slice_in_dim(a, f.astype(a.dtype), first, axis=2)
      for a, f in zip(kv, fresh)
    )

  def step(self, canvas, x_BL, kv, start, static_start):
    return base.Forward(canvas.slice_kv(x_BL, kv, start, canvas.block)[0])

  def store(self, canvas, x_BL, kv, start, more_blocks):
    def append(x, c):
      _, fresh, first = canvas.slice_kv(x, c, start, canvas.block)
      return tuple(
        jax.lax.dynamic_update_slice_in_dim(a, f, first, axis=2) for a, f in zip(c, fresh)
      )

    return jax.lax.cond(more_blocks, append, lambda x, c: c, x_BL, kv)
