"""The sampler's commit rule: which masked tokens of the current block one decoding step fixes.

Per step every masked position gets a prediction x0 (argmax, or Gumbel-max at temperature > 0)
and a confidence by the decoding order (`remasking`); the positions committed are the schedule's
count (schedules.py: LLaDA's or Dream's), the most confident or, with alg_temp > 0, drawn from
softmax(confidence / alg_temp) without replacement (Dream), plus those Fast-dLLM's rules accept:
every one at least `threshold` confident, or the n most confident with c_(n) >= 1 - factor/(n+1).
Rows whose text is final (finished_rows) can be frozen, so that they stop changing.

LLaDA2.1's token-to-token (T2T) editing (sampler.edit_threshold > 0; llada2_1 report section 2,
eq. 1-3, as SGLang's JointThreshold runs it): besides the masked positions it commits, each step
replaces every committed completion token x_i of the block whose argmax v_i differs from it and
has p(v_i) > edit_threshold (`edit_mask`); once the block's masks are gone a row keeps taking
edit-only steps until one changes nothing or it took edit_steps of them (`edit_count`). Only the
current block is edited (no multi-block editing); 0 turns it off (SGLang's 0 edits at any p).

Sources (reference/families_and_decoding.md 2.2 and 2.6): LLaDA generate.py, Dream's
generation_utils.py (orders maskgit_plus, topk_margin, entropy; alg_temp), Fast-dLLM generate.py
(threshold, factor). The forward pass that produces the logits is the sampler's (sampler.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import choices


ORDERS = choices.REMASKING_ORDERS  # sampler.remasking (diffusion/choices.py says what each is)
ENTROPY_EPS = 1e-10  # Dream's: log(p + eps), so that filtered-out tokens (p = 0) add 0.


def gumbel_noise(key, shape):
  """Standard Gumbel noise -log(E), E ~ Exp(1), correct to float32 rounding far into both tails.

  LLaDA draws Gumbel noise in float64: a float32 uniform (multiples of 2**-23 in jax) caps the noise
  near 16, cutting off unlikely tokens, which lowers the effective temperature (arXiv 2409.02908).
  x64 is off in JAX, so E = -log(W), W ~ U(0, 1), is built from 64 random bits split at W = 1/2:
  W = v below it (-log v) and W = 1 - v above it (-log1p(-v)), with v ~ U(0, 1/2] carried in
  float32's relative precision. Each half is then accurate to ~1e-7 relative, and the noise reaches
  45 (float64 uniforms: 37), so no token of probability above ~e**-45 is ever cut off.
  """
  hi, lo = jax.random.bits(key, (2,) + tuple(shape), jnp.uint32)
  upper = (hi >> 31) == 1
  v = (
    (hi & 0x7FFFFFFF).astype(jnp.float32) * 2.0**-32 + lo.astype(jnp.float32) * 2.0**-64 + 2.0**-65
  )
  exponential = jnp.where(upper, -jnp.log1p(-v), -jnp.log(v))
  return -jnp.log(exponential)


def top_p_filter(logits_V, top_p: float):
  """Logits outside the smallest top set of probability >= top_p become -inf (HF TopPLogitsWarper).

  A token is kept when the probability of the tokens strictly more likely than it is < top_p;
  tokens tied with the last kept one are kept too.
  """
  sorted_V = -jnp.sort(-logits_V, axis=-1)
  probs_V = jax.nn.softmax(sorted_V, axis=-1)
  before_V = jnp.cumsum(probs_V, axis=-1) - probs_V
  num_kept = jnp.sum(before_V < top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_V, num_kept - 1, axis=-1)
  return jnp.where(logits_V >= cutoff, logits_V, -jnp.inf)


def sample_tokens(logits_V, key, temperature: float, top_p: float = 1.0):
  """argmax at temperature 0; else a draw from softmax(top_p(logits) / T) by Gumbel-max.

  Top-p comes before the temperature, as MegaDLMs does. argmax(l + T g) = argmax(l / T + g) is
  LLaDA's argmax(exp(l) / E**T).
  """
  if temperature == 0:
    return jnp.argmax(logits_V, axis=-1).astype(jnp.int32)
  if top_p < 1:
    logits_V = top_p_filter(logits_V, top_p)
  noisy_V = logits_V + temperature * gumbel_noise(key, logits_V.shape)
  return jnp.argmax(noisy_V, axis=-1).astype(jnp.int32)


def sampling_probs(logits_V, temperature: float, top_p: float = 1.0):
  """The distribution sample_tokens draws from, softmax(top_p(logits) / T); at T = 0,
  softmax(top_p(logits)). Dream scores its orders on its sampling distribution; Dream applies
  top-p after the temperature, dlmjax's sampler before it (sample_tokens), and this follows the
  sampler, so that maskgit_plus is the probability of the draw. top_p=1 for logits already
  filtered (commit_step filters once for both)."""
  if top_p < 1:
    logits_V = top_p_filter(logits_V, top_p)
  if temperature > 0:
    logits_V = logits_V / temperature
  return jax.nn.softmax(logits_V, axis=-1)


def confidence(
  logits_V,
  x0,
  order: str,
  key,
  *,
  temperature: float = 0.0,
  top_p: float = 1.0,
  filtered_V=None,
):
  """Each position's confidence in its prediction x0 under the decoding order; higher commits
  first. logits [..., V] float32 (forbidden tokens at -inf), x0 [...] int32; key: random's draw;
  filtered_V: top_p_filter(logits, top_p) where the caller has it already (the orders on the
  sampling distribution read it instead of sorting the vocabulary again)."""
  if order == 'low_confidence':  # the clean (un-noised, un-tempered) softmax.
    chosen = jnp.take_along_axis(logits_V, x0[..., None], axis=-1)[..., 0]
    return jnp.exp(chosen - jax.nn.logsumexp(logits_V, axis=-1))
  if order == 'random':
    return jax.random.uniform(key, x0.shape)
  if filtered_V is None:
    probs_V = sampling_probs(logits_V, temperature, top_p)
  else:
    probs_V = sampling_probs(filtered_V, temperature)
  if order == 'maskgit_plus':
    return jnp.take_along_axis(probs_V, x0[..., None], axis=-1)[..., 0]
  if order == 'margin':
    top2 = jax.lax.top_k(probs_V, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if order == 'entropy':  # the negative entropy: 0 for a one-hot prediction.
    return jnp.sum(probs_V * jnp.log(probs_V + ENTROPY_EPS), axis=-1)
  raise ValueError(f'unknown decoding order {order!r}; known: {ORDERS}.')


def rank_descending(conf_BK):
  """Each entry's rank (0 = largest) along the last axis; ties broken by position (stable)."""
  order_BK = jnp.argsort(-conf_BK, axis=-1, stable=True)
  return jnp.argsort(order_BK, axis=-1)


def scheduled(conf_BK, count_B, key, alg_temp: float = 0.0):
  """bool [B, K]: count_B[b] positions of row b, the most confident (alg_temp 0) or drawn without
  replacement with probabilities softmax(conf / alg_temp) (Dream's torch.multinomial, here as
  Gumbel-top-k: the top count of conf / alg_temp + Gumbel noise is such a draw). Positions at
  -inf confidence (not masked) come last."""
  scores_BK = conf_BK
  if alg_temp > 0:
    scores_BK = jnp.where(
      conf_BK > -jnp.inf, conf_BK / alg_temp + gumbel_noise(key, conf_BK.shape), -jnp.inf
    )
  return rank_descending(scores_BK) < count_B[:, None]


def factor_accepts(conf_BK, factor: float):
  """bool [B, K]: Fast-dLLM's factor rule. With the confidences sorted, c_(1) >= c_(2) >= ...,
  the n-th most confident is accepted when c_(n) >= 1 - factor / (n + 1), the first always.
  The bound rises with n while c_(n) falls, so the accepted ones are the longest such prefix, as
  Fast-dLLM's loop finds it (without its quirk of accepting every token when only the last one
  fails)."""
  n_BK = rank_descending(conf_BK) + 1
  return (n_BK == 1) | (conf_BK >= 1 - factor / (n_BK + 1))


def entropy(logits_BKV):
  """H = -sum_v p_v log(p_v + 1e-12) of softmax(logits) (dParallel's, un-tempered)."""
  p = jax.nn.softmax(logits_BKV.astype(jnp.float32), axis=-1)
  return -jnp.sum(p * jnp.log(p + 1e-12), axis=-1)


def commit_step(
  logits_BKV,
  x_BK,
  count_B,
  keys,
  settings,
  *,
  mask_id: int,
  frozen_B=None,
  decodable_BK=None,
  with_x0: bool = False,
):
  """One decoding step over the current block: x_BK with the committed predictions written in
  (with_x0: and the predictions x0_BK it commits from, wd1++'s x_0|l).

  logits_BKV: float32 logits of the block (forbidden tokens at -inf; MASK's kept where
  settings.mask_in_softmax, so that the order scores with it); count_B: the schedule's
  tokens for this step; keys: (noise key, remasking key) of the step (block_loop.step_keys);
  settings: a SamplingConfig; frozen_B: rows that must not change (their text is final);
  decodable_BK: the completion's positions (a block may start inside the prompt, whose MASK ids
  stay), default all.
  """
  noise_key, remask_key = keys
  masked_BK = x_BK == mask_id
  if decodable_BK is not None:
    masked_BK = masked_BK & decodable_BK
  if frozen_B is not None:
    masked_BK = masked_BK & ~frozen_B[:, None]
  scores_BKV = logits_BKV  # the distribution the order scores.
  mask_in_softmax = getattr(settings, 'mask_in_softmax', False)
  if mask_in_softmax:  # LLaDA's and Dream's scores; the prediction is still never MASK.
    vocab_V = jnp.arange(logits_BKV.shape[-1])
    logits_BKV = jnp.where(vocab_V == mask_id, -jnp.inf, logits_BKV)
  # Top-p sorts the vocabulary at every position: once a step, for the draw and the order.
  filtered_BKV = top_p_filter(logits_BKV, settings.top_p) if settings.top_p < 1 else logits_BKV
  x0_BK = sample_tokens(filtered_BKV, noise_key, settings.temperature)
  conf_BK = confidence(
    scores_BKV,
    x0_BK,
    settings.remasking,
    remask_key,
    temperature=settings.temperature,
    top_p=settings.top_p,
    filtered_V=None if mask_in_softmax else filtered_BKV,
  )
  conf_BK = jnp.where(masked_BK, conf_BK, -jnp.inf)
  order_key = jax.random.fold_in(remask_key, 1)  # alg_temp's draw, apart from random's.
  commit_BK = masked_BK & scheduled(conf_BK, count_B, order_key, settings.alg_temp)
  if settings.threshold > 0:
    commit_BK = commit_BK | (masked_BK & (conf_BK >= settings.threshold))
  if settings.factor > 0:
    commit_BK = commit_BK | (masked_BK & factor_accepts(conf_BK, settings.factor))
  if settings.entropy_threshold > 0:  # dParallel's get_transfer_index_entropy
    commit_BK = commit_BK | (masked_BK & (entropy(scores_BKV) <= settings.entropy_threshold))
  new_BK = jnp.where(commit_BK, x0_BK, x_BK)
  if getattr(settings, 'edit_threshold', 0.0) > 0:
    editable_BK = x_BK != mask_id
    if decodable_BK is not None:
      editable_BK = editable_BK & decodable_BK
    if frozen_B is not None:
      editable_BK = editable_BK & ~frozen_B[:, None]
    # The clean softmax without MASK (v is never MASK), whatever mask_in_softmax says.
    edited_BK, v_BK = edit_mask(logits_BKV, x_BK, editable_BK, settings.edit_threshold)
    new_BK = jnp.where(edited_BK, v_BK, new_BK)
  return (new_BK, x0_BK) if with_x0 else new_BK


def edit_mask(logits_BKV, x_BK, editable_BK, edit_threshold: float):
  """(bool [B, K], int32 [B, K]): LLaDA2.1's edit set, the editable positions (committed,
  unfrozen completion tokens) whose argmax v differs from their token and has softmax(logits)[v]
  > edit_threshold, and v. logits: forbidden tokens at -inf (MASK included)."""
  v_BK = jnp.argmax(logits_BKV, axis=-1).astype(jnp.int32)
  top_BK = jnp.take_along_axis(logits_BKV, v_BK[..., None], axis=-1)[..., 0]
  p_BK = jnp.exp(top_BK - jax.nn.logsumexp(logits_BKV, axis=-1))
  return editable_BK & (x_BK != v_BK) & (p_BK > edit_threshold), v_BK


def edit_count(post_B, masked_B, changed_BK, edit_steps: int):
  """Each row's edit-only steps after one more step: a step that began with no mask in the
  block counts one; a row whose step without masks changed nothing, or whose count reached
  edit_steps, is done (edit_steps + 1: frozen from then on). masked_B: the block held a mask
  before the step; changed_BK: the positions the step changed."""
  post_B = jnp.where(masked_B, post_B, post_B + 1)
  stop_B = ~masked_B & (~jnp.any(changed_BK, -1) | (post_B >= edit_steps))
  return jnp.where(stop_B, edit_steps + 1, post_B)


def finished_rows(x_BL, start, *, mask_id: int, eos_id: int):
  """bool [B]: rows whose text is final: read from the completion's start (position `start`, an
  int or one per row [B]), the first token that is EOS or MASK is an EOS. The text ends at that
  EOS and everything before it is committed, and committed tokens never change, so whatever the
  rest of the row becomes, its text (and RL's completion, rewritten to EOS after the first one)
  is the same."""
  start_B1 = jnp.broadcast_to(jnp.asarray(start, jnp.int32), x_BL.shape[:1])[:, None]
  completion_BL = jnp.arange(x_BL.shape[1])[None] >= start_B1
  stop_BL = ((x_BL == eos_id) | (x_BL == mask_id)) & completion_BL
  first_B = jnp.argmax(stop_BL, axis=1)
  at_first = jnp.take_along_axis(x_BL, first_B[:, None], axis=1)[:, 0]
  return jnp.any(stop_BL, axis=1) & (at_first == eos_id)
