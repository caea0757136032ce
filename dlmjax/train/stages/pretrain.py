"""Pre-training: token samples from the data pipeline, MegaDLMs' masked-diffusion (or AR) loss."""

from __future__ import annotations

import functools

from dlmjax import config as config_lib
from dlmjax.data import pipeline
from dlmjax.diffusion import loss as loss_lib


def loss_fn(config):
  """loss(module, tokens, **randomness_and_fields) -> (objective, sums) for the shared step."""
  objective = loss_lib.OBJECTIVES[config.diffusion.objective]
  head = dict(chunk_size=config.model.loss_chunk_tokens,
              token_shards=config_lib.batch_parallelism(config))

  def fn(module, tokens, **kwargs):
    return objective(functools.partial(loss_lib.model_cross_entropy, module, **head), tokens,
                     **kwargs)

  return fn


def batch_iterator(config, *, process_index: int, process_count: int):
  return pipeline.make_batch_iterator(config, split='train', process_index=process_index,
                                      process_count=process_count)
