"""'prefix': Fast-dLLM v1's prefix cache (generate_with_prefix_cache). A refresh is the whole
canvas's forward, keeping every layer's K/V; the other steps run [block start, canvas end)
against the kept prefix K/V, their fresh K/V in place of the kept ones. Approximate for
bidirectional attention (the prefix's K/V do not see the block's commits until the refresh)."""

from __future__ import annotations

from dlmjax.diffusion.cache_modes import base


class PrefixCache(base.CacheMode):
  name = 'prefix'
  description = "Fast-dLLM's prefix cache (approximate)"
  static_blocks = True  # the slice runs from the block start to the canvas end.
  refreshing = True

  def refresh(self, canvas, x_BL, start):
    hidden, kv = canvas.hidden_kv(x_BL)
    return base.Forward(canvas.guided(hidden, start)), kv

  def step(self, canvas, x_BL, kv, start, static_start):
    size = canvas.length - static_start
    return base.Forward(canvas.slice_kv(x_BL, kv, start, size)[0])
