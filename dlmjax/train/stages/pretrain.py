"""Pre-training: token samples from the data pipeline, MegaDLMs' masked-diffusion (or AR) loss."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.data import blend, indexed, pipeline
from dlmjax.data.errors import DataError
from dlmjax.diffusion import loss as loss_lib
from dlmjax.train import evaluation
from dlmjax.train.stages import base


def make_loss(config):
  """loss(module, tokens, **randomness_and_fields) -> (objective, sums) for the shared step.

  MegaDLMs back-propagates each micro-batch's num / den divided by the micro-batch count: the
  objective is that share, so the step's sum over micro-batches is their mean.
  """
  objective = loss_lib.OBJECTIVES[config.diffusion.objective]
  num_micro = config_lib.num_microbatches(config)
  head = dict(
    chunk_size=config.model.loss_chunk_tokens,
    token_shards=config_lib.batch_parallelism(config),
    exclude_ids=loss_lib.excluded_ids(config),
  )
  bound = dict(
    seed=config.seed, mask_id=config.model.mask_token_id, varlen_prob=config.diffusion.varlen_prob
  )
  if config.diffusion.objective == 'block':
    bound['block_size'] = config.model.block_size

  def fn(module, tokens, **kwargs):
    loss, sums = objective(
      functools.partial(loss_lib.model_cross_entropy, module, **head), tokens, **{**bound, **kwargs}
    )
    return loss / num_micro, sums

  return fn


def metrics(sums) -> dict:
  """MegaDLMs' `lm loss` (sum num / sum den over micro-batches) and what the console shows."""
  return dict(
    loss=sums['loss_num'] / sums['loss_den'],
    masked_ce=sums['masked_ce_sum'] / jnp.maximum(sums['masked_count'], 1.0),
    mask_ratio=sums['mask_ratio_sum'] / sums['rows'],
    real_input_length=sums['length_sum'] / sums['micro_batches'],
    tokens=sums['loss_den'],
  )


def stage(config) -> base.Stage:
  packing = config.data.packing
  keys = ('tokens', 'segment_ids') if packing else ('tokens',)  # int32 [rows, seq_len + 1]

  def batches(setup, process_index, process_count):
    del setup
    return base.DataBatches(
      pipeline.make_batch_iterator(
        config, split='train', process_index=process_index, process_count=process_count
      )
    )

  def evaluator(setup):
    """The loss (masks from config.EVAL_SEED) on the pipeline's 'valid' split, read as the run
    reads it."""
    return evaluation.LossEvaluator(
      config,
      setup,
      make_loss(evaluation.eval_config(config)),
      keys,
      metrics,
      lambda process_index, process_count: pipeline.make_batch_iterator(
        config, split='valid', process_index=process_index, process_count=process_count
      ),
    )

  def example_batch(rng):
    tokens = base.random_tokens(
      config, rng, (config.train.global_batch_size, config.model.seq_len + 1)
    )
    if not packing:
      return {'tokens': tokens}
    return {
      'tokens': tokens,
      'segment_ids': pipeline.document_segment_ids(tokens, config.model.eos_token_id),
    }

  return base.Stage(
    name='pretrain',
    loss=make_loss(config),
    batch_keys=keys,
    metrics=metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=example_batch,
    console_metrics=('masked_ce',),
    flag_spikes=True,
    check_inputs=lambda: check_prefixes(config),
    data_keys=(
      'data.source',
      'data.train_prefixes',
      'data.valid_prefixes',
      'data.split',
      'model.seq_len',
      'seed',
    ),
  )


def check_prefixes(config) -> None:
  """Megatron data (data.source=megatron): every prefix of the blends has its .idx and .bin, and
  they open (header, sizes and offsets checked: a truncated file is named here, in a second,
  not after the model is built)."""
  data = config.data
  if data.source != 'megatron':
    return
  for key in ('train_prefixes', 'valid_prefixes'):
    if key == 'valid_prefixes' and not data.valid_prefixes:
      continue
    for prefix in blend.parse_blend(data[key])[0]:  # names a blend with no prefixes
      missing = [p for p in (prefix + '.idx', prefix + '.bin') if not os.path.isfile(p)]
      if missing:
        raise DataError(
          f'data.{key}: {" and ".join(missing)} not found; give the prefix of an indexed '
          'dataset (path without .bin/.idx; `python -m dlmjax.preprocess` writes them) with '
          f'--config.data.{key}.'
        )
      indexed.IndexedDataset(prefix)  # raises DataError naming a truncated or corrupt file
