"""The MC likelihood against a numpy statement of LLaDA's get_loglikelihood, and its expectation
against the exact ELBO enumerated over every mask set."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import likelihood
from tests.checkpoint import tiny_run

MASK = 3


WIDTH = 16


@pytest.fixture(scope='module')
def tiny():
  cfg = model_lib.ModelConfig.from_config(tiny_run.tiny_config())
  params = jax.jit(lambda key: model_lib.init_params(cfg, key))(jax.random.key(1))
  forward = jax.jit(lambda tokens: model_lib.merge(cfg, params)(tokens))
  return cfg, params, lambda tokens: np.asarray(forward(np.asarray(tokens, np.int32)), np.float64)


@pytest.fixture(scope='module')
def plain_fn(tiny):
  """The default path (no CFG, full logits), compiled once for [4, WIDTH] batches."""
  cfg, _, _ = tiny
  settings = likelihood.LikelihoodConfig(mc_num=6, mc_batch=3)
  return likelihood.make_log_likelihood_fn(cfg, settings, mask_id=MASK)


def _log_softmax(logits):
  logits = logits - logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _llada_reference(forward, context, continuation, key, *, mc_num, rows, width, cfg=0.0):
  """LLaDA's get_loglikelihood loop for one pair, unpadded, with its draws taken from `key`."""
  seq = np.array(list(context) + list(continuation))
  c, n_tokens, total = len(context), len(seq), len(continuation)
  losses = []
  for r in range(mc_num // rows):
    k, u = likelihood.round_draws(jax.random.fold_in(key, r)[None], jnp.array([total]), rows, width)
    k, u = int(k[0]), np.asarray(u[0])
    x = np.round(np.linspace(k, k + (rows - 1) * (total / rows), rows)).astype(int)
    x = ((x - 1) % total) + 1
    perm = np.argsort(np.argsort(u[:, c:n_tokens], axis=1), axis=1)  # randperm from the uniforms
    is_mask = np.concatenate([np.zeros((rows, c), bool), perm < x[:, None]], axis=1)
    noisy = np.where(is_mask, MASK, seq[None])
    logits = forward(noisy)
    if cfg:
      un = forward(np.where(np.arange(n_tokens) < c, MASK, noisy))
      logits = un + (cfg + 1) * (logits - un)
    ce = -np.take_along_axis(
      _log_softmax(logits), np.broadcast_to(seq, noisy.shape)[..., None], -1
    )[..., 0]
    p_mask = (x / total)[:, None]
    losses.append(np.sum(np.where(is_mask, ce / p_mask, 0.0)) / rows)
  return -np.mean(losses)


PAIRS = [
  ([5, 9, 17, 4, 8], [11, 12, 13, 14]),
  ([], [7, 6, 5, 4, 30, 31]),
  ([40] * 9, [41]),
  ([50, 51], [52, 53, 54, 55, 56, 57, 58]),
]


@pytest.mark.parametrize('cfg_scale', [0.0, 1.5])
def test_matches_llada_loop_on_padded_batch(tiny, plain_fn, cfg_scale):
  cfg, params, forward = tiny
  # mc_batch 3: i*T/3 never ends in .5, so LLaDA's float rounding and ours agree exactly.
  fn = (
    plain_fn
    if cfg_scale == 0
    else likelihood.make_log_likelihood_fn(
      cfg, likelihood.LikelihoodConfig(mc_num=6, mc_batch=3, cfg_scale=cfg_scale), mask_id=MASK
    )
  )
  width = WIDTH
  tokens, context_lengths, lengths = likelihood.pad_pairs(PAIRS, 0, width)
  key = jax.random.key(7)
  got = np.asarray(fn(params, tokens, context_lengths, lengths, key))
  want = [
    _llada_reference(forward, c, y, key, mc_num=6, rows=3, width=width, cfg=cfg_scale)
    for c, y in PAIRS
  ]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # A one-token continuation has one mask set: the estimate is its exact log-probability.
  c, y = PAIRS[2]
  noisy = np.array([c + [MASK]])
  logits = forward(noisy)
  if cfg_scale:
    un = forward(np.full_like(noisy, MASK))
    logits = un + (cfg_scale + 1) * (logits - un)
  np.testing.assert_allclose(got[2], _log_softmax(logits)[0, -1, y[0]], rtol=2e-5)


def test_shifted_model_matches_the_loop_on_shifted_logits(tiny):
  """model.shift_logits (Dream): the MC likelihood of the shifted model is LLaDA's loop on the
  unshifted model's logits moved right by one (Dream's cat([l[:, :1], l[:, :-1]])), position 0
  (an empty context's first continuation token) scored from its own."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  cfg, params, forward = tiny

  def dream_forward(tokens):
    logits = forward(tokens)
    return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)

  shifted = dataclasses.replace(cfg, shift_logits=True)
  fn = likelihood.make_log_likelihood_fn(
    shifted, likelihood.LikelihoodConfig(mc_num=6, mc_batch=3), mask_id=MASK
  )
  tokens, context_lengths, lengths = likelihood.pad_pairs(PAIRS, 0, WIDTH)
  key = jax.random.key(7)
  got = np.asarray(fn(params, tokens, context_lengths, lengths, key))
  want = [
    _llada_reference(dream_forward, c, y, key, mc_num=6, rows=3, width=WIDTH) for c, y in PAIRS
  ]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_rows_do_not_depend_on_their_batch(tiny, plain_fn):
  _, params, _ = tiny
  score = functools.partial(
    likelihood.score_pairs,
    plain_fn,
    params,
    key=jax.random.key(3),
    pad_id=0,
    max_length=WIDTH,
    batch_size=4,
    width_multiple=WIDTH,
  )
  together = score(PAIRS[::-1])  # sorted by length inside, returned in input order
  alone = score(PAIRS[1:2])
  np.testing.assert_allclose(alone[0], together[2], rtol=1e-5)
  assert score([([1, 2], [])])[0] == 0.0


def _exact_elbo(forward, context, continuation):
  """E_n E_S [(T/n) sum_{i in S} log p(y_i | S masked)], n ~ U{1..T}, S uniform of size n."""
  seq = np.array(list(context) + list(continuation))
  c, total = len(context), len(continuation)
  subsets = [s for n in range(1, total + 1) for s in itertools.combinations(range(c, len(seq)), n)]
  noisy = np.repeat(seq[None], len(subsets), 0)
  for row, subset in enumerate(subsets):
    noisy[row, list(subset)] = MASK
  logp = _log_softmax(forward(noisy))  # every mask set in one forward pass
  elbo = 0.0
  for row, subset in enumerate(subsets):
    n = len(subset)
    term = sum(logp[row, i, seq[i]] for i in subset) * total / n
    elbo += term / math.comb(total, n) / total
  return elbo


def test_expectation_is_the_exact_elbo(tiny, plain_fn):
  _, params, forward = tiny
  context, continuation = [21, 22, 23], [24, 25, 26, 27]
  exact = _exact_elbo(forward, context, continuation)
  tokens, context_lengths, lengths = likelihood.pad_pairs([(context, continuation)] * 4, 0, WIDTH)
  # 48 independent estimates (each averages 2 stratified rounds of 3 rows).
  estimates = np.array(
    [
      float(plain_fn(params, tokens, context_lengths, lengths, jax.random.key(100 + seed))[0])
      for seed in range(48)
    ]
  )
  stderr = estimates.std(ddof=1) / np.sqrt(len(estimates))
  assert stderr > 0
  assert abs(estimates.mean() - exact) < 4 * stderr, (estimates.mean(), exact, stderr)


def test_stratified_counts_are_exactly_uniform():
  for total in range(1, 13):
    for rows in range(1, 9):
      counts = np.asarray(
        likelihood.stratified_counts(np.arange(1, total + 1)[:, None], total, rows)
      )
      for i in range(rows):  # as k runs over 1..T, each row's count runs over 1..T once.
        assert sorted(counts[:, i]) == list(range(1, total + 1)), (total, rows, i)
  # LLaDA's float round-half-to-even: T=3, R=2 gives row 1 the counts {2, 1, 1}, never 3.
  llada = [((round(k + 1.5) - 1) % 3) + 1 for k in (1, 2, 3)]
  assert sorted(llada) == [1, 1, 2]
  ours = np.asarray(likelihood.stratified_counts(np.arange(1, 4)[:, None], 3, 2))[:, 1]
  assert sorted(ours) == [1, 2, 3]


def test_bad_settings_and_pairs():
  with pytest.raises(ValueError, match='must divide mc_num'):
    likelihood.LikelihoodConfig(mc_num=10, mc_batch=4).validate()
  with pytest.raises(ValueError, match='cfg_scale'):
    likelihood.LikelihoodConfig(cfg_scale=-1).validate()
  with pytest.raises(ValueError, match='exceeds the model length'):
    likelihood.fit_pair([1], [2] * 9, 8)
  assert likelihood.fit_pair([1, 2, 3, 4], [5, 6], 4) == ([3, 4], [5, 6])
