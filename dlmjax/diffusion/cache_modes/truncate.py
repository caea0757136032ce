"""'truncate': the canvas up to the current block's end, never what follows it; exact only where
nothing up to the block end can see past it (causal and block-causal attention)."""

from __future__ import annotations

from dlmjax.diffusion.cache_modes import base


class Truncate(base.CacheMode):
  name = 'truncate'
  description = 'the canvas up to the block end (exact for causal / block-causal models)'
  static_blocks = True  # the forward's length is the block's end.

  def check(self, model_cfg, sampling):
    base.check_exact(model_cfg, sampling)

  def step(self, canvas, x_BL, state, start, static_start):
    return base.Forward(canvas.guided(canvas.hidden(x_BL, static_start + canvas.block), start))
