"""Pre-training: token samples from the data pipeline, MegaDLMs' masked-diffusion (or AR) loss."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.data import pipeline
from dlmjax.diffusion import loss as loss_lib


def loss_fn(config):
  """loss(module, tokens, **randomness_and_fields) -> (objective, sums) for the shared step."""
  objective = loss_lib.OBJECTIVES[config.diffusion.objective]
  head = dict(chunk_size=config.model.loss_chunk_tokens,
              token_shards=config_lib.batch_parallelism(config))
  bound = dict(seed=config.seed, mask_id=config.model.mask_token_id,
               varlen_prob=config.diffusion.varlen_prob)

  def fn(module, tokens, **kwargs):
    return objective(functools.partial(loss_lib.model_cross_entropy, module, **head), tokens,
                     **{**bound, **kwargs})

  return fn


def batch_iterator(config, *, process_index: int, process_count: int):
  return pipeline.make_batch_iterator(config, split='train', process_index=process_index,
                                      process_count=process_count)


def batch_keys(config) -> tuple[str, ...]:
  """The arrays of a batch, each [global_batch_size, seq_len + 1] int32."""
  return ('tokens', 'segment_ids') if config.data.packing else ('tokens',)


def metrics(sums) -> dict:
  """MegaDLMs' `lm loss` (sum num / sum den over micro-batches) and what the console shows."""
  return dict(
      loss=sums['loss_num'] / sums['loss_den'],
      masked_ce=sums['masked_ce_sum'] / jnp.maximum(sums['masked_count'], 1.0),
      mask_ratio=sums['mask_ratio_sum'] / sums['rows'],
      real_input_length=sums['length_sum'] / sums['micro_batches'],
      tokens=sums['loss_den'],
  )
