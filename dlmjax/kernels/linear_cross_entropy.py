"""Output head + cross-entropy fused so the float32 [T, V] logits never exist.

At 16k tokens x 50k vocab the f32 logits and their gradient take 3.3 GB each. A `lax.scan` over
token chunks keeps one [C, V] chunk alive at a time, and a custom VJP recomputes each chunk's
logits in the backward pass instead of saving them: 4 head matmuls instead of 3, for T/C times
less memory (the idea of MaxText's vocabulary tiling and Levanter's blockwise CE).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def linear_cross_entropy(
  hidden_TD,
  weight_DV,
  targets_T,
  *,
  chunk_size: int = 4096,
  compute_dtype=None,
  token_shards: int = 1,
  bias_V=None,
):
  """Per-token float32 `logsumexp(h W + b) - (h W + b)[target]`, computed chunk by chunk.

  Args:
    hidden_TD: final hidden states, bf16 or f32 (flatten [B, L, D] to [B*L, D] first).
    weight_DV: the output head (the f32 master weight); cast to the compute dtype for the matmuls,
      which accumulate in f32.
    targets_T: integer token ids.
    chunk_size: most tokens per chunk, counted over all devices (each computes chunk_size /
      token_shards rows at a time). T is split into ceil(T / chunk_size) equal chunks, padding
      fewer than that many rows when T does not divide (padding a sharded T costs a reshard).
    compute_dtype: dtype of the matmul inputs; the hidden's dtype when None.
    token_shards: the number of devices the tokens are sharded over (a multiple of it also works).
      The backward then keeps one f32 d_W partial per shard, so XLA sums d_W across devices once
      after the loop instead of all-reducing [D, V] once per chunk. Costs token_shards * D * V
      f32 in all, one [D, V] per device when sharded; leave it at 1 on a single device.
    bias_V: a float32 [V] constant added to every row's logits (0, or -inf on the columns the
      softmax leaves out: the vocabulary's padding rows, SUBS's MASK); None adds nothing.

  Returns:
    ce_T in float32. Gradients reach hidden (in its dtype) and weight (in its dtype, accumulated
    in f32); targets get none.
  """
  args = dict(chunk_size=chunk_size, compute_dtype=compute_dtype, token_shards=token_shards)
  return _run(hidden_TD, weight_DV, targets_T, bias_V, temperature=None, **args)[0]


def linear_cross_entropy_and_entropy(
  hidden_TD,
  weight_DV,
  targets_T,
  *,
  temperature: float,
  chunk_size: int = 4096,
  compute_dtype=None,
  token_shards: int = 1,
  bias_V=None,
):
  """linear_cross_entropy's CE, plus what a certainty term needs from the same chunks: each
  token's entropy of softmax((h W + b) / temperature) and whether its argmax is the target
  (dParallel's certainty forcing, arXiv 2509.26488: the entropy on correctly predicted tokens).

  Returns:
    (ce_T, entropy_T, hit_T), float32; hit_T is 1.0 where argmax(h W + b) == target (ties go to
    the lowest id, as jnp.argmax) and carries no gradient; ce and entropy both do.
  """
  if not temperature > 0:
    raise ValueError(f'temperature {temperature} must be > 0')
  args = dict(chunk_size=chunk_size, compute_dtype=compute_dtype, token_shards=token_shards)
  return _run(hidden_TD, weight_DV, targets_T, bias_V, temperature=float(temperature), **args)


def _run(
  hidden_TD, weight_DV, targets_T, bias_V, *, temperature, chunk_size, compute_dtype, token_shards
):
  """Checks, pads T to equal chunks, runs the fused op and drops the padding."""
  num_tokens, _ = hidden_TD.shape
  if targets_T.shape != (num_tokens,):
    raise ValueError(f'targets {targets_T.shape} do not match hidden {hidden_TD.shape}')
  if chunk_size < 1 or token_shards < 1:
    raise ValueError(f'chunk_size {chunk_size} and token_shards {token_shards} must be positive')
  dtype = jnp.dtype(hidden_TD.dtype if compute_dtype is None else compute_dtype)
  num_chunks = max(1, -(-num_tokens // chunk_size))
  rows = -(-num_tokens // num_chunks)
  if rows % token_shards:
    raise ValueError(
      f'{rows} tokens per chunk (T={num_tokens}, chunk_size={chunk_size}) do not '
      f'split over token_shards={token_shards}; use a chunk_size that divides T '
      'into chunks of a multiple of token_shards rows'
    )
  pad = num_chunks * rows - num_tokens
  if pad:  # Padded rows get a zero cotangent from the slice below, so they add nothing to d_W.
    hidden_TD = jnp.pad(hidden_TD, ((0, pad), (0, 0)))
    targets_T = jnp.pad(targets_T, (0, pad))
  use_bias = bias_V is not None
  bias_V = jnp.zeros((weight_DV.shape[1],), jnp.float32) if bias_V is None else bias_V
  static = (num_chunks, dtype, token_shards, use_bias, temperature)
  outs = _fused(hidden_TD, weight_DV, targets_T, jnp.asarray(bias_V), *static)
  return tuple(o[:num_tokens] for o in outs)


def _split(x_T, num_chunks):
  """[T, ...] -> [N, C, ...] with chunk n holding tokens c * N + n.

  Strided, not contiguous: a T sharded in contiguous blocks over devices reshapes to a C sharded
  the same way, so every chunk is spread over all devices and each works on its own tokens.
  Contiguous chunks would put the scanned axis on the devices: XLA then all-gathers the hidden
  states and every device computes every chunk.
  """
  x_CN = x_T.reshape(-1, num_chunks, *x_T.shape[1:])
  return jnp.swapaxes(x_CN, 0, 1)


def _merge(x_NC):
  """Inverse of `_split`."""
  return jnp.swapaxes(x_NC, 0, 1).reshape(-1, *x_NC.shape[2:])


def _logits(h_CD, w_DV, bias_V, use_bias):
  logits_CV = jnp.einsum(
    'cd,dv->cv', h_CD.astype(w_DV.dtype), w_DV, preferred_element_type=jnp.float32
  )
  return logits_CV + bias_V[None] if use_bias else logits_CV


def _is_target(t_C, vocab):
  """One-hot mask by comparing with an iota rather than gathering, so a vocab-sharded chunk
  needs no gather across devices: the target logit is a masked sum XLA reduces like the lse."""
  return t_C[:, None] == jax.lax.broadcasted_iota(t_C.dtype, (t_C.shape[0], vocab), 1)


def _tempered(logits_CV, max_C, temperature):
  """(log q, q, entropy) of q = softmax(logits / temperature); 0 log 0 = 0 on -inf columns."""
  u_CV = (logits_CV - max_C[:, None]) / temperature
  log_q_CV = u_CV - jax.nn.logsumexp(u_CV, axis=-1, keepdims=True)
  q_CV = jnp.exp(log_q_CV)
  entropy_C = -jnp.sum(jnp.where(q_CV > 0, q_CV * log_q_CV, 0.0), axis=-1)
  return log_q_CV, q_CV, entropy_C


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(
  hidden_TD, weight_DV, targets_T, bias_V, num_chunks, dtype, token_shards, use_bias, temperature
):
  """(ce_T,), or with a temperature (ce_T, entropy_T, hit_T)."""
  args = (hidden_TD, weight_DV, targets_T, bias_V, num_chunks, dtype, token_shards, use_bias)
  return _fused_fwd(*args, temperature)[0]


def _fused_fwd(
  hidden_TD, weight_DV, targets_T, bias_V, num_chunks, dtype, token_shards, use_bias, temperature
):
  del token_shards  # Only the backward's d_W sum needs it.
  w_DV = weight_DV.astype(dtype)
  vocab = w_DV.shape[1]

  def chunk(carry, xs):
    h_CD, t_C = xs
    logits_CV = _logits(h_CD, w_DV, bias_V, use_bias)
    max_C = jnp.max(logits_CV, axis=-1)
    lse_C = max_C + jnp.log(jnp.sum(jnp.exp(logits_CV - max_C[:, None]), axis=-1))
    target_C = jnp.sum(jnp.where(_is_target(t_C, vocab), logits_CV, 0.0), axis=-1)
    if temperature is None:
      return carry, ((lse_C - target_C,), lse_C, ())
    entropy_C = _tempered(logits_CV, max_C, temperature)[2]
    hit_C = (jnp.argmax(logits_CV, axis=-1) == t_C).astype(jnp.float32)
    return carry, ((lse_C - target_C, entropy_C, hit_C), lse_C, (entropy_C,))

  xs = (_split(hidden_TD, num_chunks), _split(targets_T, num_chunks))
  _, (outs_NC, lse_NC, extra_NC) = jax.lax.scan(chunk, None, xs)
  outs = tuple(_merge(o) for o in outs_NC)
  return outs, (hidden_TD, weight_DV, targets_T, bias_V, lse_NC, extra_NC)


def _fused_bwd(num_chunks, dtype, token_shards, use_bias, temperature, residuals, d_outs):
  hidden_TD, weight_DV, targets_T, bias_V, lse_NC, extra_NC = residuals
  w_DV = weight_DV.astype(dtype)
  dim, vocab = w_DV.shape

  def chunk(d_w_GDV, xs):
    h_CD, t_C, lse_C, g_C, extra_C, g_extra_C = xs
    logits_CV = _logits(h_CD, w_DV, bias_V, use_bias)
    probs_CV = jnp.exp(logits_CV - lse_C[:, None])
    d_logits_CV = (probs_CV - _is_target(t_C, vocab)) * g_C[:, None]
    if temperature is not None:
      # dH/dz_v = -q_v (log q_v + H) / T for q = softmax(z / T), H its entropy.
      (entropy_C,), (g_entropy_C,) = extra_C, g_extra_C
      max_C = jnp.max(logits_CV, axis=-1)
      log_q_CV, q_CV, _ = _tempered(logits_CV, max_C, temperature)
      d_entropy_CV = jnp.where(q_CV > 0, -q_CV * (log_q_CV + entropy_C[:, None]), 0.0)
      d_logits_CV += d_entropy_CV * (g_entropy_C / temperature)[:, None]
    # Cast to the compute dtype so both matmuls run at bf16 rate, as autodiff of the bf16 head
    # would; their sums still accumulate in f32.
    d_logits_CV = d_logits_CV.astype(dtype)
    d_h_CD = jnp.einsum('cv,dv->cd', d_logits_CV, w_DV, preferred_element_type=jnp.float32)
    # Group g holds the g-th contiguous block of the chunk's rows: one device's tokens.
    h_GCD = h_CD.astype(dtype).reshape(token_shards, -1, dim)
    d_w_GDV += jnp.einsum(
      'gcd,gcv->gdv',
      h_GCD,
      d_logits_CV.reshape(token_shards, -1, vocab),
      preferred_element_type=jnp.float32,
    )
    return d_w_GDV, d_h_CD.astype(hidden_TD.dtype)

  split = functools.partial(_split, num_chunks=num_chunks)
  # The hit output carries no gradient: its cotangent is dropped.
  g_extra = () if temperature is None else (split(d_outs[1].astype(jnp.float32)),)
  xs = (
    split(hidden_TD),
    split(targets_T),
    lse_NC,
    split(d_outs[0].astype(jnp.float32)),
    extra_NC,
    g_extra,
  )
  zeros_GDV = jnp.zeros((token_shards, dim, vocab), jnp.float32)
  d_w_GDV, d_h_NCD = jax.lax.scan(chunk, zeros_GDV, xs)
  d_w_DV = jnp.sum(d_w_GDV, axis=0).astype(weight_DV.dtype)
  return _merge(d_h_NCD), d_w_DV, None, jnp.zeros_like(bias_V)


_fused.defvjp(_fused_fwd, _fused_bwd)
