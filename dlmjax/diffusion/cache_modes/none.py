"""'none': the whole canvas every step, no cache (LLaDA's loop)."""

from __future__ import annotations

from dlmjax.diffusion.cache_modes import base


class NoCache(base.CacheMode):
  name = 'none'
  description = 'the whole canvas every step'

  def step(self, canvas, x_BL, state, start, static_start):
    hidden = canvas.hidden(x_BL)
    return base.Forward(canvas.guided(hidden, start), hidden)
