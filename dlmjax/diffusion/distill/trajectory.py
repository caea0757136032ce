"""d3LLM's pseudo-trajectory distillation (arXiv 2601.07568; hao-ai-lab/d3LLM
d3llm_llada_train.py, `forward_process_with_trajectory`): the teacher's decoding order picks the
active block's masks. With a ratio r ~ U[cur, max] (the progressive-noise curriculum cur = min +
(step / steps)(max - min), min 0, max 0.8), the block's k = int((1 - r) * len) tokens the teacher
committed first stay clean and the rest are masked: d3LLM reads the trajectory state after k of
the block's tokens were decoded, which is the same set. Ties in the commit step (a step commits
several tokens) go to the earlier position. L = (CE + CE_rev + 2 L_cert) / 4, the certainty term
on the primary pass only (LLaDA's).

The commit steps are the teacher's `steps` decode record (diffusion/decode_records.py), written
by `python -m dlmjax.distill`; -1 (never committed) counts as last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion.distill import base

MIN_RATIO, MAX_RATIO = 0.0, 0.8  # d3LLM's min_mask_ratio / max_mask_ratio (LLaDA config)


def ratio(key, progress, *, low: float = MIN_RATIO, high: float = MAX_RATIO):
  """r ~ U[cur, high] with cur = low + progress (high - low): d3LLM's progressive noise."""
  cur = low + jnp.clip(progress, 0.0, 1.0) * (high - low)
  return cur + jax.random.uniform(key, ()) * (high - cur)


def late_tokens(active_L, commit_steps_L, r):
  """The active block's tokens outside its first k = int((1 - r) * len) in commit order."""
  big = jnp.iinfo(jnp.int32).max
  steps = jnp.where(commit_steps_L < 0, big - 1, commit_steps_L)
  order = jnp.lexsort((jnp.arange(active_L.shape[0]), jnp.where(active_L, steps, big)))
  rank = jnp.argsort(order)  # 0 = committed first in the block, ties by position
  count = jnp.sum(active_L)
  kept = jnp.floor((1.0 - r) * count).astype(jnp.int32)
  return active_L & (rank >= kept)


class Trajectory(base.Objective):
  name = 'trajectory'
  extra_batch_keys = ('commit_steps',)

  def block_mask(self, key, active_L, arrays_L, settings):
    r = ratio(key, settings['progress'])
    return late_tokens(active_L, arrays_L['commit_steps'], r)

  def combine(self, terms, settings):
    return (terms['ce'] + terms['ce_rev'] + settings['certainty_weight'] * terms['cert']) / 4.0

  def describe(self, settings):
    return (
      f'd3LLM trajectory masking: block {settings["block_size"]}, ratio U[cur, 0.8], '
      f'(CE + CE_rev + {settings["certainty_weight"]:g} H) / 4 at T = '
      f'{settings["temperature"]:g}'
    )


OBJECTIVE = Trajectory()
