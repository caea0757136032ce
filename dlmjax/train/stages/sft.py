"""Supervised fine-tuning: EOS-padded (or packed) conversations, LLaDA's SFT loss."""

from __future__ import annotations

import functools
import os

import numpy as np

from dlmjax import config as config_lib
from dlmjax.data import pipeline, records, roles, teacher_rows
from dlmjax.data.errors import DataError
from dlmjax.diffusion import distill, masking, sft_loss
from dlmjax.diffusion.distill import base as distill_base
from dlmjax.train import sft_rows as sft_data
from dlmjax.diffusion import loss as loss_lib
from dlmjax.train import evaluation
from dlmjax.train.stages import base


def distills(config) -> bool:
  """Whether the stage trains on the teacher's rows (an sft.objective other than llada)."""
  return distill.distills(config.sft.objective)


def make_distill_loss(config):
  """loss(module, tokens, roles=, [commit_steps=], **randomness) -> (objective, sums): the
  sft.objective's distillation loss (diffusion/distill/) over the micro-batch count; with LoRA the
  module is the adapted student, so the teacher stays the frozen init. A block-causal model reads
  the clean row as its x_0 stream (BD3LM's two-stream forward). The softmax ranges over the
  run's training vocabulary (no padded rows; MASK out under SUBS), as in the SFT loss."""
  objective = distill.get(config.sft.objective)
  num_micro = config_lib.num_microbatches(config)
  two_stream = config.diffusion.objective == 'block'
  settings = dict(
    mask_id=config.model.mask_token_id,
    block_size=config.sampler.block_length,  # the block the student decodes with
    temperature=distill_base.CERTAINTY_TEMPERATURE,
    certainty_weight=config.sft.certainty_weight,
  )
  head = dict(  # the per-token terms from the fused output head where the SFT loss uses it
    temperature=settings['temperature'],
    chunk_size=config.model.loss_chunk_tokens,
    token_shards=config_lib.batch_parallelism(config),
  )

  def fn(module, tokens, *, roles, step, micro_index, example_ids_B, **arrays):
    del micro_index
    bias_V = loss_lib.column_bias(module.cfg, loss_lib.excluded_ids(config))

    def terms_fn(noisy_BL, clean_BL, targets_BL, valid_length_B):
      kwargs = dict(clean_BL=clean_BL) if two_stream else dict(valid_length_B=valid_length_B)
      return distill_base.model_terms(module, noisy_BL, targets_BL, bias_V=bias_V, **head, **kwargs)

    progress = step / max(config.train.steps, 1)  # d3LLM's progressive noise
    loss, sums = distill_base.distill_loss(
      objective,
      terms_fn,
      tokens,
      roles,
      keys_B=masking.example_keys(config.seed, step, example_ids_B),
      settings=dict(settings, progress=progress),
      **arrays,
    )
    return loss / num_micro, sums

  return fn


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
  eval_keys = keys
  if distills(config):
    keys = ('tokens', 'roles') + distill.get(config.sft.objective).extra_batch_keys

  def batches(setup, process_index, process_count):
    del setup
    rows = None
    if distills(config):
      rows = teacher_rows.read(config.sft.teacher_file, config.model.seq_len + 1)
      rows = {k: rows[k] for k in keys}
    return base.DataBatches(
      sft_data.make_batch_iterator(
        config, process_index=process_index, process_count=process_count, rows=rows
      )
    )

  def evaluator(setup):
    """The loss (masks from config.EVAL_SEED) on held-out conversations: sft.eval_file or the
    built-in test set; LLaDA's SFT loss whatever sft.objective trains with."""
    return evaluation.LossEvaluator(
      config,
      setup,
      make_loss(evaluation.eval_config(config)),
      eval_keys,
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
    if 'commit_steps' in keys:
      batch['commit_steps'] = rng.permutation(width)[None].repeat(rows, 0).astype(np.int32)
    return batch

  return base.Stage(
    name='sft',
    loss=make_distill_loss(config) if distills(config) else make_loss(config),
    batch_keys=keys,
    metrics=distill_base.metrics if distills(config) else sft_loss.metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=example_batch,
    console_metrics=('masked_ce',),
    check_inputs=lambda: check_distill(config) if distills(config) else check_train_file(config),
    data_keys=(
      'data.source',
      'sft.train_file',
      'data.columns',
      'sft.chat_template',
      'sft.too_long',
      'sft.objective',
      'sft.teacher_file',
      'model.seq_len',
      'seed',
    ),
  )


def check_train_file(config) -> None:
  """sft.train_file, when given, exists (or names built-in tasks)."""
  path = config.sft.train_file
  if sft_data.builtin_tasks(path):
    return
  if path and not records.exists(path):
    raise DataError(
      f'sft.train_file {path!r} is not a file; set --config.sft.train_file '
      'to a jsonl/parquet of {"prompt", "response"} or {"messages": [...]} rows, hub:NAME '
      f'or {sft_data.BUILTIN_PREFIX}TASK.'
    )


def check_distill(config) -> None:
  """A distilling sft.objective's teacher rows exist (it reads them instead of sft.train_file; the
  keys: diffusion/distill/config_checks)."""
  if not os.path.isfile(config.sft.teacher_file):
    raise DataError(
      f'sft.teacher_file {config.sft.teacher_file!r} is not a file; write it with `python -m '
      'dlmjax.distill --init-from RUN --output FILE.npz`.'
    )
