"""Pre-training objectives: MegaDLMs' masked-diffusion loss, BD3LM's block diffusion and the
autoregressive baseline.

Each returns (objective to differentiate, sums to aggregate over micro-batches). MegaDLMs
back-propagates num/den per micro-batch (den = every token, masked or not), averages that over
micro-batches and data-parallel ranks, and reports sum(num)/sum(den) as `lm loss` (reference 1.4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import choices, masking
from dlmjax.kernels import linear_cross_entropy


def column_bias(cfg, exclude_ids=()):
  """A float32 [V] constant, 0 on the columns a softmax ranges over and -inf on the rest: the
  embedding's padding rows (cfg.token_vocab_size up to cfg.vocab_size, Megatron pads to a
  multiple of 128) and `exclude_ids` (SUBS: MASK). None when nothing is left out. Built in
  numpy, so each program compiles it in as one constant added to the logits."""
  real = cfg.token_vocab_size or cfg.vocab_size
  if real >= cfg.vocab_size and not exclude_ids:
    return None
  bias_V = np.zeros((cfg.vocab_size,), np.float32)
  bias_V[real:] = -np.inf
  bias_V[list(exclude_ids)] = -np.inf
  return bias_V


BLOCK_PARAMETERIZATIONS = choices.BLOCK_PARAMETERIZATIONS  # objective=block's softmax


def excluded_ids(config) -> tuple[int, ...]:
  """Token ids a run's training softmax leaves out: MASK for objective=block under BD3LM's SUBS
  parameterisation (diffusion.block_parameterization), none otherwise."""
  d = config.diffusion
  if d.objective == 'block' and d.get('block_parameterization', 'subs') == 'subs':
    return (config.model.mask_token_id,)
  return ()


def token_cross_entropy(logits_BLV, targets_BL, bias_V=None):
  """Per-token CE in float32; bias_V (column_bias) leaves columns out of the softmax."""
  logits_BLV = logits_BLV.astype(jnp.float32)
  if bias_V is not None:
    logits_BLV = logits_BLV + bias_V[(None,) * (logits_BLV.ndim - 1)]
  target_logit = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BLV, axis=-1) - target_logit


def model_cross_entropy(
  module,
  inputs_BL,
  targets_BL,
  *,
  chunk_size: int,
  token_shards: int = 1,
  exclude_ids=(),
  **model_kwargs,
):
  """Per-token CE [B, L] of the model's predictions for `targets` given `inputs`, over the
  tokenizer's vocabulary (the padding rows are no tokens) less `exclude_ids` (SUBS: MASK).

  chunk_size > 0 fuses the output head with the CE over token chunks (never materialising fp32
  [B*L, V] logits: 1.27x faster and 4.5x less memory on the 1.7B head, docs/benchmarks.md,
  Output head + cross-entropy);
  0 computes the full logits first.
  """
  bias_V = column_bias(module.cfg, exclude_ids)
  if chunk_size == 0:
    return token_cross_entropy(module(inputs_BL, **model_kwargs), targets_BL, bias_V)
  hidden_BLD = module.hidden(inputs_BL, **model_kwargs)
  batch, length, dim = hidden_BLD.shape
  ce_T = linear_cross_entropy.linear_cross_entropy(
    hidden_BLD.reshape(batch * length, dim),
    module.head_weight_DV(),
    targets_BL.reshape(-1),
    chunk_size=chunk_size,
    token_shards=token_shards,
    bias_V=bias_V,
  )
  return ce_T.reshape(batch, length)


def elbo_terms(ce_BL, masked_BL, p_BL):
  """Each token's share of the masked-diffusion ELBO: CE on masked tokens, weighted 1/p (p the
  mask probability of the token's row, document or block; MDLM's 1/t for the linear schedule)."""
  return ce_BL * masked_BL.astype(jnp.float32) / p_BL


def mdm_loss(
  ce_fn,
  tokens_BS,
  *,
  seed,
  step,
  micro_index,
  example_ids_B,
  mask_id,
  varlen_prob,
  segment_ids=None,
):
  """Masked-diffusion loss on tokens [B, S+1] (the sample's first S tokens are trained).

  loss = sum_{b,i} CE_bi * m_bi / p_b / (B * l), with l the kept length of the micro-batch.
  With segment_ids [B, S+1] (data.packing), t, p and the at-least-one-mask rule are per
  document, p_b becomes p of token i's document, and attention and positions stay per document.
  Input and target are the same token, so no label crosses a document or sample boundary
  (MegaDLMs' THD quirk (a), reference 3.6).
  """
  x_BL = tokens_BS[:, :-1]
  batch, seq_len = x_BL.shape
  length = masking.varlen_length(seed, step, micro_index, seq_len=seq_len, prob=varlen_prob)
  keys = masking.example_keys(seed, step, example_ids_B)
  valid_length_B = jnp.full((batch,), length, jnp.int32)
  model_kwargs = dict(valid_length_B=None if varlen_prob == 0 else valid_length_B)
  if segment_ids is None:
    noisy_BL, masked_BL, p_B = masking.forward_process(keys, x_BL, mask_id=mask_id, length=length)
    p_BL = p_B[:, None]
  else:
    segments_BL = segment_ids[:, :-1]
    noisy_BL, masked_BL, p_BL = masking.forward_process_segments(
      keys, x_BL, segments_BL, mask_id=mask_id, length=length
    )
    p_B = masked_BL.sum(1) / length  # the row's realised ratio, for the mask_ratio metric only.
    model_kwargs.update(
      segment_ids_BL=segments_BL, positions_BL=masking.segment_positions(segments_BL)
    )
  ce_BL = ce_fn(noisy_BL, x_BL, **model_kwargs)
  masked = masked_BL.astype(jnp.float32)
  num = jnp.sum(elbo_terms(ce_BL, masked_BL, p_BL))
  den = (batch * length).astype(jnp.float32)
  sums = dict(
    loss_num=num,
    loss_den=den,
    masked_ce_sum=jnp.sum(ce_BL * masked),
    masked_count=jnp.sum(masked),
    mask_ratio_sum=jnp.sum(p_B),
    rows=jnp.float32(batch),
    length_sum=length.astype(jnp.float32),
    micro_batches=jnp.float32(1),
  )
  return num / den, sums


BLOCK_TIME_EPS = 1e-3  # BD3LM's sampling_eps_min (configs/config.yaml); the top of t is 1.


def block_loss(
  ce_fn,
  tokens_BS,
  *,
  seed,
  step,
  micro_index,
  example_ids_B,
  mask_id,
  varlen_prob,
  block_size,
  segment_ids=None,
):
  """BD3LM's block-diffusion loss on tokens [B, S+1] (the first S are trained), one forward.

  Each block of `block_size` tokens gets its own t (masking.block_forward_process); the model
  reads [x_t || x_0] under the two-stream mask and returns x_t's predictions only
  (Transformer.hidden's clean_BL). loss = sum_{b,i} CE_bi * m_bi / t_bi / (B * l), the masked
  tokens' ELBO terms over every kept token, as BD3LM (and mdm_loss here) normalise.
  With segment_ids, attention (both streams), positions and blocks stay per document: blocks
  (their t and their mask) count from each document's start, as SDAR packs samples. SDAR trains
  the same two-stream forward but draws one t per sample (a variance choice, the same ELBO in
  expectation), so it has no switch here; docs/block_diffusion.md.
  """
  x_BL = tokens_BS[:, :-1]
  batch, seq_len = x_BL.shape
  length = masking.varlen_length(seed, step, micro_index, seq_len=seq_len, prob=varlen_prob)
  keys = masking.example_keys(seed, step, example_ids_B)
  valid_BL = jnp.broadcast_to(jnp.arange(seq_len) < length, x_BL.shape)
  model_kwargs = dict(
    clean_BL=x_BL,
    valid_length_B=None if varlen_prob == 0 else jnp.full((batch,), length, jnp.int32),
  )
  segments_BL = None
  if segment_ids is not None:
    segments_BL = segment_ids[:, :-1]
    model_kwargs.update(
      segment_ids_BL=segments_BL, positions_BL=masking.segment_positions(segments_BL)
    )
  noisy_BL, masked_BL, p_BL = masking.block_forward_process(
    keys,
    x_BL,
    valid_BL,
    block_size=block_size,
    mask_id=mask_id,
    eps=BLOCK_TIME_EPS,
    segment_ids_BL=segments_BL,
  )
  ce_BL = ce_fn(noisy_BL, x_BL, **model_kwargs)
  masked = masked_BL.astype(jnp.float32)
  num = jnp.sum(elbo_terms(ce_BL, masked_BL, p_BL))
  den = (batch * length).astype(jnp.float32)
  sums = dict(
    loss_num=num,
    loss_den=den,
    masked_ce_sum=jnp.sum(ce_BL * masked),
    masked_count=jnp.sum(masked),
    mask_ratio_sum=jnp.sum(masked) / length,
    rows=jnp.float32(batch),
    length_sum=length.astype(jnp.float32),
    micro_batches=jnp.float32(1),
  )
  return num / den, sums


def ar_loss(
  ce_fn,
  tokens_BS,
  *,
  seed,
  step,
  micro_index,
  example_ids_B,
  mask_id,
  varlen_prob,
  segment_ids=None,
):
  """Next-token CE on the sample's shifted tokens (MegaDLMs `vanilla` mode), mean over tokens.

  With segment_ids, attention and positions stay per document (Megatron's reset flags).
  """
  del example_ids_B, mask_id
  inputs_BL, targets_BL = tokens_BS[:, :-1], tokens_BS[:, 1:]
  batch, seq_len = inputs_BL.shape
  length = masking.varlen_length(seed, step, micro_index, seq_len=seq_len, prob=varlen_prob)
  valid_BL = (jnp.arange(seq_len) < length)[None].astype(jnp.float32)
  # Causal attention never looks right, so truncation needs only the loss to stop at `length`.
  model_kwargs = {}
  if segment_ids is not None:
    segments_BL = segment_ids[:, :-1]
    model_kwargs = dict(
      segment_ids_BL=segments_BL, positions_BL=masking.segment_positions(segments_BL)
    )
  ce_BL = ce_fn(inputs_BL, targets_BL, valid_length_B=None, **model_kwargs)
  num = jnp.sum(ce_BL * valid_BL)
  den = (batch * length).astype(jnp.float32)
  sums = dict(
    loss_num=num,
    loss_den=den,
    masked_ce_sum=num,
    masked_count=den,
    mask_ratio_sum=jnp.float32(0),
    rows=jnp.float32(batch),
    length_sum=length.astype(jnp.float32),
    micro_batches=jnp.float32(1),
  )
  return num / den, sums


OBJECTIVES = {'mdm': mdm_loss, 'ar': ar_loss, 'block': block_loss}
