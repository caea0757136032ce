"""Supervised fine-tuning: EOS-padded (or packed) conversations, LLaDA's SFT loss."""

from __future__ import annotations

import functools

import numpy as np

from dlmjax import config as config_lib
from dlmjax.data import pipeline, records, roles
from dlmjax.data.errors import DataError
from dlmjax.train import sft_rows as sft_data
from dlmjax.diffusion import loss as loss_lib
from dlmjax.diffusion import sft_loss
from dlmjax.train import evaluation
from dlmjax.train.stages import base


def make_loss(config):
  """loss(module, tokens, roles=, [segment_ids=], **randomness) -> (objective, sums).

  Like pre-training's, the objective is the micro-batch's loss over the micro-batch count.
  """
  num_micro = config_lib.num_microbatches(config)
  head = dict(
    chunk_size=config.model.loss_chunk_tokens,
    token_shards=config_lib.batch_parallelism(config),
    exclude_ids=loss_lib.excluded_ids(config),
  )
  bound = dict(
    seed=config.seed,
    mask_id=config.model.mask_token_id,
    supervise_padding=not config.data.packing,
    block_size=config.model.block_size if config.diffusion.objective == 'block' else 0,
  )

  def fn(module, tokens, **kwargs):
    loss, sums = sft_loss.sft_loss(
      functools.partial(loss_lib.model_cross_entropy, module, **head), tokens, **{**bound, **kwargs}
    )
    return loss / num_micro, sums

  return fn


def stage(config) -> base.Stage:
  packing = config.data.packing
  # int32 [rows, seq_len + 1] each: tokens, roles (and segment_ids when packed).
  keys = ('tokens', 'roles', 'segment_ids') if packing else ('tokens', 'roles')

  def batches(setup, process_index, process_count):
    del setup
    return base.DataBatches(
      sft_data.make_batch_iterator(config, process_index=process_index, process_count=process_count)
    )

  def evaluator(setup):
    """The loss (masks from config.EVAL_SEED) on held-out conversations: sft.eval_file or the
    built-in test set."""
    return evaluation.LossEvaluator(
      config,
      setup,
      make_loss(evaluation.eval_config(config)),
      keys,
      sft_loss.metrics,
      lambda process_index, process_count: sft_data.make_eval_batch_iterator(
        config, process_index=process_index, process_count=process_count
      ),
    )

  def example_batch(rng):
    """Rows of one conversation each: a prompt of a quarter of the row, the response after."""
    rows, width = config.train.global_batch_size, config.model.seq_len + 1
    tokens = base.random_tokens(config, rng, (rows, width))
    role_ids = np.full((rows, width), roles.RESPONSE, np.int32)
    role_ids[:, : width // 4] = roles.PROMPT
    batch = {'tokens': tokens, 'roles': role_ids}
    if packing:
      batch['segment_ids'] = pipeline.document_segment_ids(tokens, config.model.eos_token_id)
    return batch

  return base.Stage(
    name='sft',
    loss=make_loss(config),
    batch_keys=keys,
    metrics=sft_loss.metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=example_batch,
    console_metrics=('masked_ce',),
    check_inputs=lambda: check_train_file(config),
    data_keys=(
      'data.source',
      'sft.train_file',
      'data.columns',
      'sft.chat_template',
      'sft.too_long',
      'model.seq_len',
      'seed',
    ),
  )


def check_train_file(config) -> None:
  """sft.train_file, when given, exists."""
  path = config.sft.train_file
  if path and not records.exists(path):
    raise DataError(
      f'sft.train_file {path!r} is not a file; set --config.sft.train_file '
      'to a jsonl/parquet of {"prompt", "response"} or {"messages": [...]} rows, or hub:NAME.'
    )
