"""Pre-training: token samples from the data pipeline, MegaDLMs' masked-diffusion (or AR) loss."""

from __future__ import annotations

from dlmjax.data import pipeline
from dlmjax.diffusion import loss as loss_lib


def loss_fn(config):
  objective = loss_lib.OBJECTIVES[config.diffusion.objective]

  def fn(module, tokens, **kwargs):
    return objective(lambda x, **model_kwargs: module(x, **model_kwargs), tokens, **kwargs)

  return fn


def batch_iterator(config, *, process_index: int, process_count: int):
  return pipeline.make_batch_iterator(config, split='train', process_index=process_index,
                                      process_count=process_count)
