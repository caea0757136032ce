"""Plain statements of the decoding loops the sampler's fast path is held to: LLaDA's generate
loop (numpy) and, on it, Fast-dLLM v1's prefix and dual cache loops, driving the plain model
(model_lib.merge: the trained layout, weights cast at use, no fused projections).
reference/families_and_decoding.md 2.1 gives Fast-dLLM's loops."""

import functools

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.diffusion import block_loop, prompt_rows
from tests.diffusion import tiny_sampler

MASK, PAD, VOCAB = tiny_sampler.MASK, tiny_sampler.PAD, tiny_sampler.VOCAB


class PlainCache:
  """The plain model's forwards as Fast-dLLM's cached loops call them: a whole-canvas forward
  keeping every layer's K/V, and a slice of the canvas against kept K/V (the slice's fresh K/V
  in their place). float64 logits."""

  def __init__(self, model_config, params):
    self.params, self.lead = params, int(model_config.shift_logits)

    @jax.jit
    def whole(params, tokens, segments, positions):
      module = model_lib.merge(model_config, params)
      hidden, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
      return module.logits(hidden), kv

    @functools.partial(jax.jit, static_argnums=(5, 6))
    def part(params, tokens, segments, positions, kv, first, size):
      module = model_lib.merge(model_config, params)
      return tiny_sampler.slice_logits(module, tokens, segments, positions, kv, first, size)[0]

    self._whole, self._part = whole, part

  def with_params(self, params):
    """The same forwards (compiled once) over other params of the same shapes."""
    other = object.__new__(PlainCache)
    other.__dict__.update(self.__dict__, params=params)
    return other

  def refresh(self, tokens, segments, positions):
    logits, kv = self._whole(self.params, tokens, segments, positions)
    return np.asarray(logits, np.float64), kv

  def slice(self, tokens, segments, positions, kv, lo, hi):
    """Logits of the canvas rows [lo, hi) from a forward of [lo - lead, hi) against kv: a shifted
    model (Dream) reads token lo's prediction from position lo - 1, as the sampler does."""
    first = lo - self.lead
    logits = self._part(self.params, tokens, segments, positions, kv, first, hi - first)
    return np.asarray(logits, np.float64)[:, self.lead :]


def llada_reference(logits_fn, prompts, s, key=0, cache=None):
  """LLaDA generate.py at temperature 0 in numpy, plus the threshold and factor rules: (x,
  forwards). With
  s.mask_in_softmax, LLaDA's own low_confidence score: the softmax keeps MASK's logit.

  With s.cache 'prefix' or 'dual' and `cache` (a PlainCache), Fast-dLLM v1's loops: a block's
  first step (and every s.cache_refresh-th) is a whole-canvas forward whose K/V are kept; the
  other steps run dual: the block alone, prefix: the block and everything after it, against
  those K/V, and commit from the block's logits exactly as LLaDA's loop does."""
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, PAD)
  batch, width = prompt_BP.shape
  length = width + s.gen_length
  x = np.concatenate([prompt_BP, np.full((batch, s.gen_length), MASK)], 1)
  index = np.arange(length)[None]
  offset = (width - lengths_B)[:, None]
  seg, pos = (index >= offset).astype(np.int32), np.maximum(index - offset, 0)
  prompt_index = (index >= offset) & (index < width)
  rows = 2 if s.cfg_scale > 0 else 1  # CFG: the canvas, then a copy whose prompt is MASK.
  seg, pos = np.concatenate([seg] * rows), np.concatenate([pos] * rows)
  cached = cache is not None and s.cache in ('prefix', 'dual')
  spb, forwards = s.steps_per_block, 0
  refresh_every = s.cache_refresh or spb
  for nb in range(s.num_blocks):
    lo, hi = width + nb * s.block_length, width + (nb + 1) * s.block_length
    n = (x[:, lo:hi] == MASK).sum(1)
    transfer = n[:, None] // spb + (np.arange(spb)[None] < (n % spb)[:, None])
    for i in range(spb):
      mask_index = (x == MASK) & (index >= width)
      if not mask_index[:, lo:hi].any():
        break
      forwards += 1
      tokens = np.concatenate([x, np.where(prompt_index, MASK, x)][:rows])
      if not cached:
        both = logits_fn(tokens, seg, pos)
      elif i % refresh_every == 0:
        both, kv = cache.refresh(tokens, seg, pos)
      else:  # only the block's rows are read below: the rest of `both` stays zero.
        end = hi if s.cache == 'dual' else length
        block = cache.slice(tokens, seg, pos, kv, lo, end)[:, : hi - lo]
        both = np.zeros((len(tokens), length, block.shape[-1]), np.float64)
        both[:, lo:hi] = block
      logits = (
        both[batch:] + (s.cfg_scale + 1) * (both[:batch] - both[batch:]) if rows > 1 else both
      )
      logits[..., VOCAB:] = -np.inf
      scores = logits.copy()
      logits[..., MASK] = -np.inf  # dlmjax never predicts MASK (LLaDA would).
      x0 = logits.argmax(-1)
      if s.remasking == 'low_confidence':
        scored = scores if s.mask_in_softmax else logits
        p = np.exp(scored - scored.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x0_p = np.take_along_axis(p, x0[..., None], -1)[..., 0]
      else:
        x0_p = np.zeros((batch, length))
        remask_key = block_loop.step_keys(jax.random.key(key), nb, i)[1]
        x0_p[:, lo:hi] = jax.random.uniform(remask_key, (batch, s.block_length))
      x0_p[:, hi:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      confidence = np.where(mask_index, x0_p, -np.inf)
      for j in range(batch):
        order = np.argsort(-confidence[j], kind='stable')
        select = list(order[: transfer[j, i]])
        if s.threshold > 0:
          select += [q for q in order if confidence[j, q] >= s.threshold]
        if s.factor > 0:  # Fast-dLLM's: the n-th most confident while c_(n) >= 1 - f / (n + 1)
          for n, q in enumerate(order[: mask_index[j].sum()], start=1):
            if n > 1 and confidence[j, q] < 1 - s.factor / (n + 1):
              break
            select.append(q)
        x[j, select] = x0[j, select]
  return x, forwards
