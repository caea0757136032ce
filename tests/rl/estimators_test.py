"""The RL estimators (d1, coupled-GRPO, ESPO, SPG) against direct forwards of hand-masked
sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.rl import estimators
from tests.conftest import tiny_test_config


_CFG = model_lib.ModelConfig.from_config(tiny_test_config(**{'model.seq_len': 16}))


class _Jitted:
  """The estimators and a plain forward, each jitted once for the module's tests (eager model
  calls are slow on CPU)."""

  def __init__(self):
    self.params = jax.jit(lambda key: model_lib.init_params(_CFG, key))(jax.random.key(0))
    self._d1 = jax.jit(
      lambda params, tokens, prompt_lengths, lengths, seeds, p: estimators.d1_token_logprobs(
        model_lib.merge(_CFG, params),
        tokens,
        prompt_lengths,
        lengths,
        seeds,
        seed=0,
        mask_id=3,
        p_mask_prompt=p,
      )
    )
    self._elbo = jax.jit(
      lambda params, tokens, prompt_lengths, lengths, seeds: estimators.sequence_elbo(
        model_lib.merge(_CFG, params),
        tokens,
        prompt_lengths,
        lengths,
        seeds,
        seed=0,
        mask_id=3,
        num_samples=2,
      )
    )
    self._spg = jax.jit(
      lambda params, tokens, prompt_lengths, lengths, completion, seeds: (
        estimators.spg_sequence_bounds(
          model_lib.merge(_CFG, params),
          tokens,
          prompt_lengths,
          lengths,
          completion,
          seeds,
          seed=0,
          mask_id=3,
          num_samples=3,
          block_length=4,
          p_mask_prompt=0.0,
          eubo_beta=1.5,
        )
      )
    )
    self._coupled = jax.jit(
      lambda params, tokens, prompt_lengths, lengths, seeds: estimators.coupled_token_logprobs(
        model_lib.merge(_CFG, params),
        tokens,
        prompt_lengths,
        lengths,
        seeds,
        seed=0,
        mask_id=3,
        p_mask_prompt=0.0,
      )
    )
    self._forward = jax.jit(
      lambda params, tokens, lengths: model_lib.merge(_CFG, params)(tokens, valid_length_B=lengths)
    )

  def d1(self, *args, p_mask_prompt):
    return np.asarray(self._d1(self.params, *args, jnp.float32(p_mask_prompt)))

  def coupled(self, *args):
    return np.asarray(self._coupled(self.params, *args))

  def elbo(self, *args):
    return np.asarray(self._elbo(self.params, *args))

  def spg(self, *args):
    return tuple(np.asarray(x) for x in self._spg(self.params, *args))

  def __call__(self, tokens, valid_length_B):
    return self._forward(self.params, tokens, valid_length_B)


@pytest.fixture(scope='module')
def module():
  return _Jitted()


def _reference(module, tokens, prompt_len, length, mask_id):
  """log softmax of the model's logits on [prompt, MASK...] at each completion position."""
  noisy = np.array(tokens)
  noisy[prompt_len:length] = mask_id
  logits = np.asarray(module(jnp.asarray(noisy[None]), valid_length_B=jnp.array([length])))[0]
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  out = np.zeros(len(tokens))
  out[prompt_len:length] = logp[np.arange(prompt_len, length), tokens[prompt_len:length]]
  return out


def test_d1_logprobs_match_a_direct_forward(module):
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 100, (2, 12)).astype(np.int32)
  prompt_lengths, lengths = np.array([3, 5]), np.array([10, 12])
  logp = module.d1(
    jnp.asarray(tokens),
    jnp.asarray(prompt_lengths),
    jnp.asarray(lengths),
    jnp.array([7, 8]),
    p_mask_prompt=0.0,
  )
  for b in range(2):
    np.testing.assert_allclose(
      logp[b], _reference(module, tokens[b], prompt_lengths[b], lengths[b], 3), rtol=2e-4, atol=2e-4
    )


def test_prompt_masking_is_seeded_and_changes_the_estimate(module):
  tokens = jnp.asarray(np.random.default_rng(1).integers(4, 100, (2, 12)), jnp.int32)
  args = (tokens, jnp.full((2,), 6), jnp.full((2,), 12))
  a = module.d1(*args, jnp.arange(2), p_mask_prompt=0.5)
  b = module.d1(*args, jnp.arange(2), p_mask_prompt=0.5)
  c = module.d1(*args, jnp.arange(2) + 100, p_mask_prompt=0.5)
  np.testing.assert_array_equal(a, b)  # same seeds: same masks for policy, old and reference
  assert not np.allclose(a, c)  # a fresh seed per inner iteration masks other prompt tokens
  full = module.d1(*args, jnp.arange(2), p_mask_prompt=1.0)
  masked_prompt = np.array(tokens)
  masked_prompt[:, :6] = 3  # p = 1: the whole prompt is masked
  np.testing.assert_allclose(
    full,
    module.d1(jnp.asarray(masked_prompt), *args[1:], jnp.arange(2), p_mask_prompt=0.0),
    rtol=1e-5,
    atol=1e-5,
  )


def test_sequence_elbo_uses_shared_masks(module):
  tokens = jnp.asarray(np.random.default_rng(2).integers(4, 100, (2, 12)), jnp.int32)
  args = (tokens, jnp.array([4, 4]), jnp.array([12, 12]))
  a = module.elbo(*args, jnp.array([1, 2]))
  b = module.elbo(*args, jnp.array([1, 2]))
  np.testing.assert_array_equal(a, b)
  assert a.shape == (2,) and np.all(np.asarray(a) < 0)


def _masks(key, prompt_len, completion_len, width=16, block=4, p=0.0):
  return np.asarray(
    estimators.spg_block_masks(
      key, prompt_len, completion_len, width, block_length=block, p_mask_prompt=p
    )
  )


def test_spg_block_masks_follow_the_block_rule():
  prompt_len, completion_len, width, block = 3, 10, 16, 4  # blocks [3,7) [7,11) [11,13)+
  seen_blocks = set()
  for i in range(200):
    masked = _masks(jax.random.key(i), prompt_len, completion_len, width, block)
    assert not masked[:prompt_len].any()  # p_mask_prompt = 0
    assert masked[prompt_len + completion_len :].all()  # after the completion: always masked
    canvas = masked[prompt_len : prompt_len + completion_len]
    first = int(np.argmax(canvas))  # the drawn block holds the first masked token
    b = first // block
    seen_blocks.add(b)
    in_block = canvas[b * block : min((b + 1) * block, completion_len)]
    assert 1 <= in_block.sum() <= len(in_block)
    assert not canvas[: b * block].any() and canvas[(b + 1) * block :].all()
  assert seen_blocks == {0, 1, 2}
  prompt_masked = np.mean([_masks(jax.random.key(i), 8, 4, p=0.5)[:8].mean() for i in range(200)])
  assert 0.4 < prompt_masked < 0.6


def test_spg_bounds_match_direct_forwards_of_the_same_masks(module):
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 128, size=(2, 16)).astype(np.int32)
  prompt_lengths, lengths = np.array([3, 5], np.int32), np.array([15, 16], np.int32)
  completion = np.zeros((2, 16), np.float32)
  completion[0, 3:12], completion[1, 5:16] = 1, 1  # row 0's first EOS at 11: pads after it
  seeds = np.array([4, 9], np.int32)
  elbo, eubo = module.spg(tokens, prompt_lengths, lengths, completion, seeds)
  keys = jax.vmap(lambda k: jax.random.split(k, 3))(estimators.row_keys(0, jnp.asarray(seeds)))
  for b in range(2):
    comp_len = int(completion[b].sum())
    per_sample, weighted = [], np.zeros(16)
    for s in range(3):
      masked = _masks(keys[b, s], int(prompt_lengths[b]), comp_len)
      noisy = np.where(masked, 3, tokens[b])
      logits = np.asarray(module(jnp.asarray(noisy[None]), jnp.array([lengths[b]])))[0]
      logp = jax.nn.log_softmax(logits)[np.arange(16), tokens[b]]
      scored = masked & (completion[b] > 0)
      per_sample.append(logp[scored].mean())
      weighted += np.exp(1.5 * logp) * scored / (scored.sum() / comp_len) / 3
    np.testing.assert_allclose(elbo[b], np.mean(per_sample), rtol=1e-4)
    np.testing.assert_allclose(eubo[b], np.log(weighted[weighted > 0]).mean() / 1.5, rtol=1e-4)
  assert (eubo >= elbo).all()  # the sandwich: the upper bound is above the lower one


def test_coupled_logprobs_match_direct_forwards_of_complementary_masks(module):
  """DiffuCoder's coupled estimate, written out: (logp_all_masked + logp_view1 / t where view 1
  masks the token, else logp_view2 / (1 - t)) / 2, views 1 and 2 complementary."""
  rng = np.random.default_rng(5)
  tokens = rng.integers(4, 100, (2, 14)).astype(np.int32)
  prompt_lengths, lengths = np.array([3, 5], np.int32), np.array([12, 14], np.int32)
  seeds = np.array([11, 12], np.int32)
  got = module.coupled(tokens, prompt_lengths, lengths, seeds)
  completion, _, first, t = (
    np.asarray(x)
    for x in estimators.coupled_masks(
      tokens, prompt_lengths, lengths, estimators.row_keys(0, jnp.asarray(seeds)), 0.0
    )
  )
  assert ((0.2 <= t) & (t <= 0.8)).all()
  for b in range(2):
    p, n = int(prompt_lengths[b]), int(lengths[b])
    canvas = np.arange(14)[(np.arange(14) >= p) & (np.arange(14) < n)]
    np.testing.assert_array_equal(np.flatnonzero(completion[b]), canvas)
    view1 = np.zeros(14, bool)
    view1[canvas] = first[b, canvas]
    view2 = np.zeros(14, bool)
    view2[canvas] = ~first[b, canvas]  # every completion token masked in exactly one view
    assert 0 < view1.sum() < len(canvas)  # this draw masks some of each
    logps = []
    for masked in (np.isin(np.arange(14), canvas), view1, view2):
      noisy = np.where(masked, 3, tokens[b])
      logits = np.asarray(module(jnp.asarray(noisy[None]), jnp.array([n])))[0]
      logps.append(np.asarray(jax.nn.log_softmax(logits))[np.arange(14), tokens[b]])
    expected = np.zeros(14)
    coupled = np.where(view1, logps[1] / t[b], logps[2] / (1 - t[b]))
    expected[canvas] = (logps[0][canvas] + coupled[canvas]) / 2
    np.testing.assert_allclose(got[b], expected, rtol=2e-4, atol=2e-4)


# TraceRL on a block-causal model: blocks of 4; rows [prompt 5 | completion 11], so the first
# completion block holds the prompt's last token, as the sampler's first decoded block does.
_BLOCK_CFG = model_lib.ModelConfig.from_config(
  tiny_test_config(
    **{'model.seq_len': 16, 'model.attention_mask': 'block_causal', 'model.block_size': 4}
  )
)
_TRACE_PROMPT = 5
# Each completion token's commit step (-1: never committed): per block, several tokens share a
# step, steps are out of position order, and the last block has a never-committed token.
_TRACE_STEPS = np.array(
  [
    [-1] * 5 + [1, 0, 0] + [3, 2, 3, 2] + [5, 4, -1, 4],
    [-1] * 5 + [0, 1, 1] + [2, 2, 2, 3] + [4, 5, 6, 7],
  ],
  np.int32,
)


def _trace_states(tokens, steps, prompt_length, block, mask_id=3):
  """Numpy: each completion token's trajectory state (the block-causal model's input when it was
  committed): earlier blocks clean, its own block with the tokens of its step or later (and the
  never committed) masked, later blocks masked (unseen by block-causal attention anyway)."""
  states, where = [], []
  for b in range(tokens.shape[0]):
    for k in range(prompt_length, tokens.shape[1]):
      if steps[b, k] < 0:
        continue
      start = k // block * block
      x = tokens[b].copy()
      own = np.arange(start, start + block)
      late = (own >= prompt_length) & ((steps[b, own] >= steps[b, k]) | (steps[b, own] < 0))
      x[own[late]] = mask_id
      x[start + block :] = mask_id
      states.append(x)
      where.append((b, k))
  return np.stack(states), where


def test_trace_logprobs_equal_forwards_of_the_trajectory_states():
  params = jax.jit(lambda key: model_lib.init_params(_BLOCK_CFG, key))(jax.random.key(1))
  tokens = np.random.default_rng(3).integers(4, _BLOCK_CFG.vocab_size, (2, 16)).astype(np.int32)
  prompt_lengths = np.full(2, _TRACE_PROMPT, np.int32)
  lengths = np.full(2, 16, np.int32)
  got = np.asarray(
    jax.jit(
      lambda p, t, s: estimators.trace_token_logprobs(
        model_lib.merge(_BLOCK_CFG, p),
        t,
        prompt_lengths,
        lengths,
        s,
        block_size=4,
        rounds=4,
        mask_id=3,
      )
    )(params, tokens, _TRACE_STEPS)
  )
  states, where = _trace_states(tokens, _TRACE_STEPS, _TRACE_PROMPT, 4)
  logits = np.asarray(jax.jit(lambda p, x: model_lib.merge(_BLOCK_CFG, p)(x))(params, states))
  logp = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
  want = np.zeros_like(got)
  for i, (b, k) in enumerate(where):
    want[b, k] = logp[i, k, tokens[b, k]]
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  assert np.all(got[:, :_TRACE_PROMPT] == 0) and got[0, 14] == 0  # prompt, never committed
  ranks = np.asarray(
    estimators.trajectory_ranks(_TRACE_STEPS, _TRACE_STEPS >= 0, 4)
  )  # per block, the rank among its distinct steps
  assert ranks[0, 5:].tolist() == [1, 0, 0, 1, 0, 1, 0, 1, 0, 2, 0]  # the uncommitted: last
