"""'dual': Fast-dLLM v1's dual cache (generate_with_dual_cache). A refresh is the whole canvas's
forward, keeping every layer's K/V; the other steps run the block alone against the kept K/V of
the prefix and the suffix, its fresh K/V in place of the kept ones. Approximate for
bidirectional attention."""

from __future__ import annotations

from dlmjax.diffusion.cache_modes import base


class DualCache(base.CacheMode):
  name = 'dual'
  description = "Fast-dLLM's dual cache (approximate)"
  refreshing = True

  def refresh(self, canvas, x_BL, start):
    hidden, kv = canvas.hidden_kv(x_BL)
    return base.Forward(canvas.guided(hidden, start)), kv

  def step(self, canvas, x_BL, kv, start, static_start):
    return base.Forward(canvas.slice_kv(x_BL, kv, start, canvas.block)[0])
