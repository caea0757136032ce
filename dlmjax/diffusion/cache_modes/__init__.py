"""The sampler's cache modes, one module each (base.py says what a mode is).

'none': the whole canvas every step. 'truncate': the canvas up to the current block's end, exact
only where nothing sees past it. 'prefix' and 'dual': Fast-dLLM's approximate K/V caches for any
attention. 'block': an exact cache of the prompt and committed blocks for causal and block-causal
models. A new mode is one module here and its entry in MODES.
"""

from __future__ import annotations

from dlmjax.diffusion.cache_modes import base, block, dual, none, prefix, truncate

MODES: dict[str, base.CacheMode] = {
  mode.name: mode
  for mode in (
    none.NoCache(),
    truncate.Truncate(),
    prefix.PrefixCache(),
    dual.DualCache(),
    block.BlockCache(),
  )
}


def get(name: str) -> base.CacheMode:
  """The mode called name; an unknown name fails naming the known ones."""
  if name not in MODES:
    raise ValueError(f'unknown cache {name!r}; known: {tuple(MODES)}.')
  return MODES[name]
