"""Pre-training objectives: MegaDLMs' masked-diffusion loss and the autoregressive baseline.

Each returns (objective to differentiate, sums to aggregate over micro-batches). MegaDLMs
back-propagates num/den per micro-batch (den = every token, masked or not), averages that over
micro-batches and data-parallel ranks, and reports sum(num)/sum(den) as `lm loss` (reference 1.4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import masking


def token_cross_entropy(logits_BLV, targets_BL):
  """Per-token CE in float32."""
  logits_BLV = logits_BLV.astype(jnp.float32)
  target_logit = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BLV, axis=-1) - target_logit


def mdm_loss(apply_fn, tokens_BS, *, seed, step, micro_index, example_ids_B, mask_id, varlen_prob):
  """Masked-diffusion loss on tokens [B, S+1] (the sample's first S tokens are trained).

  loss = sum_{b,i} CE_bi * m_bi / p_b / (B * l), with l the kept length of the micro-batch.
  """
  x_BL = tokens_BS[:, :-1]
  seq_len = x_BL.shape[1]
  length = masking.varlen_length(seed, step, micro_index, seq_len=seq_len, prob=varlen_prob)
  keys = masking.example_keys(seed, step, example_ids_B)
  noisy_BL, masked_BL, p_B = masking.forward_process(keys, x_BL, mask_id=mask_id, length=length)
  batch = x_BL.shape[0]
  valid_length_B = jnp.full((batch,), length, jnp.int32)
  logits_BLV = apply_fn(noisy_BL, valid_length_B=None if varlen_prob == 0 else valid_length_B)
  ce_BL = token_cross_entropy(logits_BLV, x_BL)
  masked = masked_BL.astype(jnp.float32)
  num = jnp.sum(ce_BL * masked / p_B[:, None])
  den = (batch * length).astype(jnp.float32)
  sums = dict(loss_num=num, loss_den=den, masked_ce_sum=jnp.sum(ce_BL * masked),
              masked_count=jnp.sum(masked), mask_ratio_sum=jnp.sum(p_B), rows=jnp.float32(batch),
              length_sum=length.astype(jnp.float32), micro_batches=jnp.float32(1))
  return num / den, sums


def ar_loss(apply_fn, tokens_BS, *, seed, step, micro_index, example_ids_B, mask_id, varlen_prob):
  """Next-token CE on the sample's shifted tokens (MegaDLMs `vanilla` mode), mean over tokens."""
  del example_ids_B, mask_id
  inputs_BL, targets_BL = tokens_BS[:, :-1], tokens_BS[:, 1:]
  batch, seq_len = inputs_BL.shape
  length = masking.varlen_length(seed, step, micro_index, seq_len=seq_len, prob=varlen_prob)
  valid_BL = (jnp.arange(seq_len) < length)[None].astype(jnp.float32)
  # Causal attention never looks right, so truncation needs only the loss to stop at `length`.
  ce_BL = token_cross_entropy(apply_fn(inputs_BL, valid_length_B=None), targets_BL)
  num = jnp.sum(ce_BL * valid_BL)
  den = (batch * length).astype(jnp.float32)
  sums = dict(loss_num=num, loss_den=den, masked_ce_sum=num, masked_count=den,
              mask_ratio_sum=jnp.float32(0), rows=jnp.float32(batch),
              length_sum=length.astype(jnp.float32), micro_batches=jnp.float32(1))
  return num / den, sums


OBJECTIVES = {'mdm': mdm_loss, 'ar': ar_loss}
