"""What a distillation objective declares, and the pieces dParallel and d3LLM share.

Both train the student on the frozen teacher's own completions with a semi-autoregressive mask
(dParallel, arXiv 2509.26488, `forward_process_semi_ar`; d3LLM, arXiv 2601.07568,
`forward_process_with_trajectory`): per row one active block of the response is chosen, the
context before it stays clean, the block is partly masked (how: the objective's `block_mask`), the
future after it is all MASK and not learnt; a second, complementary pass masks the block's other
tokens. The losses are token means of CE over the masked block tokens and of the certainty term,
the entropy of softmax(logits / T) on the masked tokens the student already predicts right.
An objective is one module of this package; adding one is a module and its line in REGISTRY.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.data.roles import PADDING, RESPONSE
from dlmjax.diffusion import sft_loss
from dlmjax.kernels import linear_cross_entropy

TIME_EPS = 1e-3  # dParallel's p = (1 - eps) t + eps
CERTAINTY_TEMPERATURE = 0.5  # T of the certainty entropy: both papers' (a constant of theirs)


def active_block(key, maskable_L, *, block_size: int):
  """(active [L] bool, future [L] bool) of one row (dParallel's semi-AR forward process): with P
  the response's first position, R its length (EOS padding included) and n ~ U{0 .. R // b},
  the active block is [P + n b, P + n b + b), running to the row's end when n = R // b; the
  future is every response position after it."""
  length = maskable_L.shape[0]
  positions = jnp.arange(length)
  first = jnp.argmax(maskable_L)  # P (rows are prompt, then response to the end)
  response = jnp.sum(maskable_L)
  last_block = response // block_size
  n = jax.random.randint(key, (), 0, last_block + 1)
  start = first + n * block_size
  end = jnp.where(n == last_block, length, start + block_size)
  active = (positions >= start) & (positions < end) & maskable_L
  return active, (positions >= end) & maskable_L


def logit_terms(logits_BLV, targets_BL, *, temperature: float, bias_V=None):
  """Per-token (CE, H(softmax(z / T)), argmax z == y) from full logits, the plain formulas:
  CE = -log softmax(z)[y], H = -sum q log(q + 1e-12) (dParallel's), the hit as float32."""
  z = logits_BLV.astype(jnp.float32)
  if bias_V is not None:
    z = z + bias_V[(None,) * (z.ndim - 1)]
  logp = jax.nn.log_softmax(z, axis=-1)
  ce = -jnp.take_along_axis(logp, targets_BL[..., None], axis=-1)[..., 0]
  q = jax.nn.softmax(z / temperature, axis=-1)
  entropy = -jnp.sum(q * jnp.log(q + 1e-12), axis=-1)
  return ce, entropy, (jnp.argmax(z, axis=-1) == targets_BL).astype(jnp.float32)


def model_terms(
  module, inputs_BL, targets_BL, *, temperature, chunk_size, token_shards=1, bias_V=None, **kwargs
):
  """logit_terms of the student's predictions for `targets` given `inputs`; chunk_size > 0 takes
  them from the fused output head (kernels/linear_cross_entropy, as the SFT loss does), so the
  float32 [B, L, V] logits never exist; 0 from the full logits."""
  if chunk_size == 0:
    logits = module(inputs_BL, **kwargs)
    return logit_terms(logits, targets_BL, temperature=temperature, bias_V=bias_V)
  hidden_BLD = module.hidden(inputs_BL, **kwargs)
  batch, length, dim = hidden_BLD.shape
  terms = linear_cross_entropy.linear_cross_entropy_and_entropy(
    hidden_BLD.reshape(batch * length, dim),
    module.head_weight_DV(),
    targets_BL.reshape(-1),
    temperature=temperature,
    chunk_size=chunk_size,
    token_shards=token_shards,
    bias_V=bias_V,
  )
  return tuple(t.reshape(batch, length) for t in terms)


def masked_mean(values_BL, masked_BL):
  """(1/|M|) sum_{i in M} v_i: a mean over masked tokens (dParallel's CE has no 1/t weight)."""
  m = masked_BL.astype(jnp.float32)
  return jnp.sum(values_BL * m) / jnp.maximum(jnp.sum(m), 1.0)


def certainty(entropy_BL, hit_BL, masked_BL):
  """dParallel's certainty term: (1/|M_c|) sum_{i in M_c} H_i, M_c the masked tokens whose
  argmax is the target (a selection without gradient; H has one)."""
  return masked_mean(entropy_BL, jax.lax.stop_gradient(masked_BL & (hit_BL > 0)))


class Objective:
  """One distillation objective (sft.objective).

  name: the sft.objective value. extra_batch_keys: arrays the teacher rows carry beyond tokens and
  roles. block_mask(key, active_L, arrays_L, settings) -> the primary pass's masked block tokens
  [L] bool. combine(terms) -> the loss from the two passes' {'ce', 'ce_rev', 'cert',
  'cert_rev'}."""

  name = ''
  extra_batch_keys: tuple[str, ...] = ()

  def block_mask(self, key, active_L, arrays_L, settings):
    raise NotImplementedError

  def combine(self, terms, settings):
    raise NotImplementedError

  def describe(self, settings) -> str:
    raise NotImplementedError


def pass_masks(objective, keys_B, maskable_BL, arrays_BL, settings):
  """(primary, complementary, future) [B, L] bool: the two passes' learnt tokens (a partition of
  the active block) and the fully masked future."""

  def one_row(key, maskable_L, row_arrays):
    key_block, key_mask = jax.random.split(key)
    active_L, future_L = active_block(key_block, maskable_L, block_size=settings['block_size'])
    primary_L = objective.block_mask(key_mask, active_L, row_arrays, settings) & active_L
    return primary_L, active_L & ~primary_L, future_L

  return jax.vmap(one_row)(keys_B, maskable_BL, arrays_BL)


def maskable_rows(keys_B, roles_BL):
  """(maskable [B, L] bool, end_B): the response and its EOS padding up to each row's random
  canvas end (sft_loss.random_canvas_ends, as SFT: the student must not learn where the
  canvas ends either), the row past it hidden from attention."""
  end_B, kept_BL = sft_loss.random_canvas_ends(keys_B, roles_BL)
  return ((roles_BL == RESPONSE) | (roles_BL == PADDING)) & kept_BL, end_B


def distill_loss(objective, terms_fn, tokens_BS, roles, *, keys_B, settings, **arrays):
  """The objective's loss of teacher rows [B, S+1] (the first S are the canvas, as in SFT) and
  its sums. terms_fn(noisy_BL, clean_BL, targets_BL, valid_length_B) -> per-token (CE, entropy,
  hit) [B, L] (model_terms or logit_terms of the student's forward, attending to each row's
  first valid_length_B tokens; a block-causal one reads clean_BL as its x_0 stream). Both passes
  run as one forward of 2B rows."""
  x_BL = tokens_BS[:, :-1]
  roles_BL = roles[:, :-1]
  maskable_BL, end_B = maskable_rows(keys_B, roles_BL)
  arrays_BL = {k: v[:, :-1] for k, v in arrays.items()}
  mask_id = settings['mask_id']

  primary_BL, reverse_BL, future_BL = pass_masks(
    objective, keys_B, maskable_BL, arrays_BL, settings
  )
  noisy = [jnp.where(m | future_BL, mask_id, x_BL) for m in (primary_BL, reverse_BL)]
  clean = jnp.concatenate([x_BL, x_BL], axis=0)
  ce, entropy, hit = (
    jnp.split(t, 2, axis=0)
    for t in terms_fn(jnp.concatenate(noisy, axis=0), clean, clean, jnp.concatenate([end_B] * 2))
  )
  terms = dict(
    ce=masked_mean(ce[0], primary_BL),
    ce_rev=masked_mean(ce[1], reverse_BL),
    cert=certainty(entropy[0], hit[0], primary_BL),
    cert_rev=certainty(entropy[1], hit[1], reverse_BL),
  )
  loss = objective.combine(terms, settings)
  batch, length = x_BL.shape
  masked = jnp.sum(primary_BL) + jnp.sum(reverse_BL)
  sums = dict(
    loss_num=loss,
    loss_den=jnp.float32(1.0),
    ce_sum=terms['ce'] + terms['ce_rev'],
    certainty_sum=terms['cert'] + terms['cert_rev'],
    passes=jnp.float32(2.0),
    masked_count=masked.astype(jnp.float32),
    maskable_count=jnp.sum(maskable_BL).astype(jnp.float32),
    tokens=jnp.float32(batch * length),
  )
  return loss, sums


def metrics(sums) -> dict:
  """Step metrics from the micro-batches' sums (each micro-batch's terms are means)."""
  micro = sums['loss_den']
  return dict(
    loss=sums['loss_num'] / micro,
    masked_ce=sums['ce_sum'] / sums['passes'],
    certainty=sums['certainty_sum'] / sums['passes'],
    masked_tokens=sums['masked_count'],
    response_tokens=sums['maskable_count'],
    tokens=sums['tokens'],
  )
