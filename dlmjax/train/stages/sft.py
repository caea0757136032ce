"""Supervised fine-tuning: EOS-padded (or packed) conversations, LLaDA's SFT loss."""

from __future__ import annotations

import functools

from dlmjax import config as config_lib
from dlmjax.data import sft as sft_data
from dlmjax.diffusion import loss as loss_lib
from dlmjax.diffusion import sft_loss


def loss_fn(config):
  """loss(module, tokens, roles=, [segment_ids=], **randomness) -> (objective, sums)."""
  head = dict(chunk_size=config.model.loss_chunk_tokens,
              token_shards=config_lib.batch_parallelism(config))
  bound = dict(seed=config.seed, mask_id=config.model.mask_token_id,
               supervise_padding=not config.data.packing)

  def fn(module, tokens, **kwargs):
    return sft_loss.sft_loss(functools.partial(loss_lib.model_cross_entropy, module, **head),
                             tokens, **{**bound, **kwargs})

  return fn


def batch_iterator(config, *, process_index: int, process_count: int):
  return sft_data.make_batch_iterator(config, process_index=process_index,
                                      process_count=process_count)


def eval_batch_iterator(config, *, process_index: int, process_count: int):
  """Held-out conversations for val_loss (eval.every): sft.eval_file or the built-in test set."""
  return sft_data.make_eval_batch_iterator(config, process_index=process_index,
                                           process_count=process_count)


def batch_keys(config) -> tuple[str, ...]:
  """int32 [global_batch_size, seq_len + 1] each: tokens, roles (and segment_ids when packed)."""
  return ('tokens', 'roles', 'segment_ids') if config.data.packing else ('tokens', 'roles')


metrics = sft_loss.metrics
