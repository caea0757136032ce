"""LLaDA's Monte Carlo estimate of log p(continuation | context), one primitive for eval and RL.

The estimate is the masked-diffusion ELBO in LLaDA's low-variance form (get_log_likelihood.py,
eval_llada.py; reference dlm_peers 1.4): mask exactly n of the T continuation tokens, n ~ U{1..T}
stratified over the rows of one forward pass, positions uniformly at random, the context never;
weight each masked token's cross-entropy by 1/p = T/n:

  log p(y | c) >= E_n E_S [ (T/n) sum_{i in S} log p(y_i | c, y with S masked) ].

Rows are right-padded (attention stops at each row's length), every draw derives from a per-row
key, so a row's estimate does not depend on what it is batched with.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax.observability import progress
from dlmjax.diffusion import loss as loss_lib


@dataclasses.dataclass(frozen=True)
class LikelihoodConfig:
  """LLaDA's defaults: mc_num 128 samples, batch_size 32 per forward pass, no CFG."""

  mc_num: int = 128  # Monte Carlo samples per sequence.
  mc_batch: int = 32  # samples per forward pass and per stratified group (LLaDA `batch_size`).
  cfg_scale: float = 0.0  # unsupervised CFG: un + (cfg + 1)(cond - un), context masked in un.
  chunk_tokens: int = 0  # > 0: fused head + CE over token chunks (no CFG); 0: full logits.

  def validate(self) -> None:
    if self.mc_num < 1 or self.mc_batch < 1:
      raise ValueError(f'mc_num={self.mc_num} and mc_batch={self.mc_batch} must be positive.')
    if self.mc_num % self.mc_batch:
      raise ValueError(
        f'mc_batch={self.mc_batch} must divide mc_num={self.mc_num} (samples come '
        'in whole stratified groups); e.g. mc_num=128 with mc_batch=32.'
      )
    if self.cfg_scale < 0:
      raise ValueError(f'cfg_scale={self.cfg_scale} must be >= 0 (0 turns guidance off).')
    if self.chunk_tokens < 0:
      raise ValueError(f'chunk_tokens={self.chunk_tokens} must be >= 0.')


def stratified_counts(k, target_len, num_rows: int):
  """Masked-token counts [num_rows] in 1..T: k, k + T/R, k + 2T/R, ... wrapped into 1..T.

  LLaDA rounds k + i*T/R in floating point, half to even, which ties the offset to k's parity
  when i*T/R ends in .5 (T=3, R=2 then never draws n=3: a biased estimate). The offset here is
  round-half-up of i*T/R in exact integers, so each row's count is exactly uniform over 1..T
  as k is; elsewhere the counts equal LLaDA's. Works on numpy and traced values alike.
  """
  i = np.arange(num_rows)
  offset = (2 * i * target_len + num_rows) // (2 * num_rows)
  return (k - 1 + offset) % target_len + 1


def round_draws(keys_B, target_lengths_B, num_rows: int, length: int):
  """One round's randomness per row: k [B] ~ U{1..T} and uniforms [B, R, L] that order positions."""

  def one(key, target_len):
    key_k, key_u = jax.random.split(key)
    k = jax.random.randint(key_k, (), 1, jnp.maximum(target_len, 1) + 1)
    return k, jax.random.uniform(key_u, (num_rows, length))

  return jax.vmap(one)(keys_B, target_lengths_B)


def continuation_masks(keys_B, context_lengths_B, lengths_B, *, num_rows: int, length: int):
  """(masked [B, R, L] bool, counts [B, R]): row r of sequence b masks counts[b, r] continuation
  positions chosen uniformly (the smallest of its uniforms, i.e. LLaDA's randperm)."""
  positions_1L = jnp.arange(length)[None]
  continuation_BL = (positions_1L >= context_lengths_B[:, None]) & (
    positions_1L < lengths_B[:, None]
  )
  target_lengths_B = lengths_B - context_lengths_B
  k_B, u_BRL = round_draws(keys_B, target_lengths_B, num_rows, length)
  counts_BR = jax.vmap(stratified_counts, (0, 0, None))(
    k_B, jnp.maximum(target_lengths_B, 1), num_rows
  )
  score_BRL = jnp.where(continuation_BL[:, None], u_BRL, 2.0)  # other positions rank last.
  rank_BRL = jnp.argsort(jnp.argsort(score_BRL, axis=-1), axis=-1)
  masked_BRL = (rank_BRL < counts_BR[..., None]) & continuation_BL[:, None]
  return masked_BRL, counts_BR


def _token_ce(module, noisy_NL, tokens_NL, context_NL, valid_length_N, settings, mask_id):
  """CE [N, L] of the clean tokens under the model's prediction from the noisy rows."""
  if settings.cfg_scale == 0:
    return loss_lib.model_cross_entropy(
      module, noisy_NL, tokens_NL, chunk_size=settings.chunk_tokens, valid_length_B=valid_length_N
    )
  # SMDM's unsupervised CFG as LLaDA applies it: a copy with the context masked, one forward.
  unconditional_NL = jnp.where(context_NL, mask_id, noisy_NL)
  logits = module(
    jnp.concatenate([noisy_NL, unconditional_NL]),
    valid_length_B=jnp.concatenate([valid_length_N, valid_length_N]),
  )
  conditional, unconditional = jnp.split(logits.astype(jnp.float32), 2)
  guided = unconditional + (settings.cfg_scale + 1) * (conditional - unconditional)
  return loss_lib.token_cross_entropy(guided, tokens_NL, loss_lib.column_bias(module.cfg))


def log_likelihood(
  module,
  tokens_BL,
  context_lengths_B,
  lengths_B,
  keys_B,
  settings: LikelihoodConfig,
  *,
  mask_id: int,
):
  """Estimates log p(continuation | context) [B] float32; traceable and differentiable.

  Row b is tokens_BL[b, :lengths_B[b]]: context [0, context_lengths_B[b]), continuation after
  it; the rest is padding no valid token attends to. An empty continuation scores 0. keys_B
  holds one PRNG key per row (the same key for every row gives common random numbers).
  """
  settings.validate()
  batch, length = tokens_BL.shape
  rows = settings.mc_batch
  context_lengths_B = context_lengths_B.astype(jnp.int32)
  lengths_B = lengths_B.astype(jnp.int32)
  target_lengths_B = (lengths_B - context_lengths_B).astype(jnp.float32)
  context_BL = jnp.arange(length)[None] < context_lengths_B[:, None]

  def tile(x_B):  # [B, ...] -> [B * R, ...], sequence-major like the reshaped masks.
    return jnp.repeat(x_B, rows, axis=0)

  def one_round(total_B, round_index):
    round_keys_B = jax.vmap(lambda key: jax.random.fold_in(key, round_index))(keys_B)
    masked_BRL, counts_BR = continuation_masks(
      round_keys_B, context_lengths_B, lengths_B, num_rows=rows, length=length
    )
    noisy_BRL = jnp.where(masked_BRL, mask_id, tokens_BL[:, None])
    ce_NL = _token_ce(
      module,
      noisy_BRL.reshape(batch * rows, length),
      tile(tokens_BL),
      tile(context_BL),
      tile(lengths_B),
      settings,
      mask_id,
    )
    weight_BR = target_lengths_B[:, None] / counts_BR.astype(jnp.float32)  # 1 / p, p = n / T
    ce_BRL = jnp.where(masked_BRL, ce_NL.reshape(batch, rows, length), 0.0)
    return total_B + jnp.sum(ce_BRL.sum(-1) * weight_BR, axis=1) / rows, None

  total_B, _ = jax.lax.scan(
    one_round, jnp.zeros((batch,), jnp.float32), jnp.arange(settings.mc_num // rows)
  )
  return -total_B / (settings.mc_num // rows)


def make_log_likelihood_fn(model_config, settings: LikelihoodConfig, *, mask_id: int):
  """fn(params, tokens_BL, context_lengths_B, lengths_B, key) -> [B], jitted; one compilation
  per (B, L). Every row uses `key` (common random numbers across rows)."""
  settings.validate()

  @jax.jit
  def fn(params, tokens_BL, context_lengths_B, lengths_B, key):
    keys_B = jnp.broadcast_to(key, tokens_BL.shape[:1])
    return log_likelihood(
      model_lib.merge(model_config, params),
      tokens_BL,
      context_lengths_B,
      lengths_B,
      keys_B,
      settings,
      mask_id=mask_id,
    )

  return fn


# ----------------------------------------------------------------------------------------------
# Host side: lists of token pairs in, numpy scores out


def pad_pairs(pairs, pad_id: int, width: int):
  """[(context ids, continuation ids)] -> (tokens [B, width], context_lengths [B], lengths [B])."""
  tokens = np.full((len(pairs), width), pad_id, np.int32)
  context_lengths = np.zeros(len(pairs), np.int32)
  lengths = np.zeros(len(pairs), np.int32)
  for b, (context, continuation) in enumerate(pairs):
    row = list(context) + list(continuation)
    tokens[b, : len(row)] = row
    context_lengths[b], lengths[b] = len(context), len(row)
  return tokens, context_lengths, lengths


def fit_pair(context, continuation, max_length: int):
  """Drops the context's oldest tokens so the pair fits max_length (as lm-eval's HF model)."""
  if len(continuation) > max_length:
    raise ValueError(
      f'a continuation of {len(continuation)} tokens exceeds the model length '
      f'{max_length}; shorten it or use a model with a longer model.seq_len.'
    )
  keep = max_length - len(continuation)
  return list(context)[max(0, len(context) - keep) :], list(continuation)


def score_pairs(
  fn,
  params,
  pairs,
  *,
  key,
  pad_id: int,
  max_length: int,
  batch_size: int = 8,
  width_multiple: int = 32,
) -> np.ndarray:
  """log p(continuation | context) for each (context ids, continuation ids) pair, float64 [N].

  Pairs are sorted by length and scored batch_size at a time, padded to a multiple of
  width_multiple (few distinct shapes, so few compilations); results come back in input order.
  """
  pairs = [fit_pair(c, y, max_length) for c, y in pairs]
  order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
  scores = np.zeros(len(pairs), np.float64)
  for start in progress.track(range(0, len(order), batch_size), 'score'):
    chunk = order[start : start + batch_size]
    longest = max(len(pairs[i][0]) + len(pairs[i][1]) for i in chunk)
    width = min(max(width_multiple, -(-longest // width_multiple) * width_multiple), max_length)
    batch = [pairs[i] for i in chunk] + [((), ())] * (batch_size - len(chunk))  # fixed B
    tokens, context_lengths, lengths = pad_pairs(batch, pad_id, max(width, longest))
    out = np.asarray(jax.device_get(fn(params, tokens, context_lengths, lengths, key)))
    scores[chunk] = out[: len(chunk)]
  return scores
