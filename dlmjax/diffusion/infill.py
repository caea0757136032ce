"""Infilling (fill-in-the-middle): MASK tokens anywhere in a text, decoded by the sampler's rule.

A template is text with holes written `<mask:N>` (N MASK tokens each). The canvas is the
template's tokens; every step runs the model over the whole canvas and commits, among all masked
positions, the schedule's count of the most confident ones (LLaDA's linear schedule over
sampling.steps, and decoding.commit_step: the same remasking, temperature, top-p, threshold and
factor rules as the sampler's blocks). commit_step writes masked positions only, so every token
outside the holes is left as it is. block_length and gen_length do not apply (the holes are the
whole generation); K/V caches and CFG are the block sampler's (dlmjax/diffusion/sampler.py) and
are refused here.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from dlmjax import model as model_lib
from dlmjax.diffusion import decoding, schedules
from dlmjax.diffusion import block_loop
from dlmjax.model import programs

HOLE_RE = re.compile(r'<mask:(\d+)>')


def template_tokens(template: str, encode, mask_id: int) -> list[int]:
  """Token ids of a template: its text pieces encoded in order, each `<mask:N>` as N MASK ids."""
  parts = HOLE_RE.split(template)
  if len(parts) == 1:
    raise ValueError(
      f'the infill template {template[:60]!r} has no hole; write one as <mask:N> (N tokens), '
      'e.g. "def add(a, b):\\n    return <mask:6>\\n".'
    )
  ids = []
  for i, part in enumerate(parts):
    if i % 2:
      if int(part) < 1:
        raise ValueError(f'<mask:{part}> is an empty hole; give it at least one token.')
      ids += [mask_id] * int(part)
    elif part:
      ids += list(encode(part))
  return ids


def check_settings(sampling) -> None:
  if sampling.cache != 'none' or sampling.cfg_scale > 0 or sampling.stop_at_eos:
    raise ValueError(
      'infilling decodes the whole canvas each step: use --cache none, --cfg 0 and no '
      '--stop-at-eos (got cache={!r}, cfg={}, stop_at_eos={}).'.format(
        sampling.cache, sampling.cfg_scale, sampling.stop_at_eos
      )
    )


def infill(module, canvas_BL, lengths_B, sampling, key, *, mask_id: int, vocab_size=None):
  """int32 [B, L]: the left-padded canvas with every MASK decoded in sampling.steps steps."""
  check_settings(sampling)
  batch, length = canvas_BL.shape
  vocab_size = vocab_size or module.cfg.vocab_size
  offset_B1 = (length - jnp.asarray(lengths_B, jnp.int32))[:, None]
  index_1L = jnp.arange(length)[None]
  segment_ids_BL = jnp.broadcast_to((index_1L >= offset_B1).astype(jnp.int32), (batch, length))
  positions_BL = jnp.maximum(index_1L - offset_B1, 0)
  x_BL = jnp.asarray(canvas_BL, jnp.int32)
  schedule = schedules.resolve(sampling.schedule, module.cfg)
  step_count = schedules.counts(
    schedule, jnp.sum(x_BL == mask_id, -1), sampling.steps, sampling.eps
  )

  def step(i, x_BL):
    hidden = module.hidden(x_BL, segment_ids_BL=segment_ids_BL, positions_BL=positions_BL)
    logits = module.logits(hidden)
    vocab_V = jnp.arange(logits.shape[-1])
    allowed_V = vocab_V < vocab_size
    if not sampling.mask_in_softmax:  # else commit_step scores with MASK and forbids it itself.
      allowed_V = allowed_V & (vocab_V != mask_id)
    logits = jnp.where(allowed_V, logits, -jnp.inf)
    count_B = step_count(i, jnp.sum(x_BL == mask_id, -1))
    keys = block_loop.step_keys(key, 0, i)
    return decoding.commit_step(logits, x_BL, count_B, keys, sampling, mask_id=mask_id)

  return jax.lax.fori_loop(0, sampling.steps, step, x_BL)


@functools.lru_cache(maxsize=16)
def make_infill_fn(model_config, sampling, *, mask_id: int, vocab_size: int | None = None):
  """jit(fn(params, canvas_BL, lengths_B, key) -> int32 [B, L]), one device."""
  check_settings(sampling)

  def fn(params, canvas_BL, lengths_B, key):
    module = model_lib.inference_module(model_config, params)
    return infill(
      module, canvas_BL, lengths_B, sampling, key, mask_id=mask_id, vocab_size=vocab_size
    )

  return programs.jit_program(fn, model_config.matmul_dtype, decode=True)
