"""The sampler's cache modes, one module each (base.py says what a mode is).

'none': the whole canvas every step. 'truncate': the canvas up to the current block's end, exact
only where nothing sees past it. 'prefix' and 'dual': Fast-dLLM's approximate K/V caches for any
attention. 'block': an exact cache of the prompt and committed blocks for causal and block-causal
models. A new mode is one module here and its entry in MODES, which names its class by reference
(imported when a sampler uses it: the names are checked before jax loads).
"""

from __future__ import annotations

import functools

from dlmjax.config import lazy

MODES: dict[str, str] = {
  'none': 'dlmjax.diffusion.cache_modes.none:NoCache',
  'truncate': 'dlmjax.diffusion.cache_modes.truncate:Truncate',
  'prefix': 'dlmjax.diffusion.cache_modes.prefix:PrefixCache',
  'dual': 'dlmjax.diffusion.cache_modes.dual:DualCache',
  'block': 'dlmjax.diffusion.cache_modes.block:BlockCache',
}


@functools.cache
def get(name: str):
  """The mode (a base.CacheMode) called name; an unknown name fails naming the known ones."""
  if name not in MODES:
    raise ValueError(f'unknown cache {name!r}; known: {tuple(MODES)}.')
  return lazy.load(MODES[name])()
