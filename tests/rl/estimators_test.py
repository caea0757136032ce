"""d1's one-step estimator against a direct forward of the hand-masked sequence."""

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
    self._d1 = jax.jit(lambda params, tokens, prompt_lengths, lengths, seeds, p: (
        estimators.d1_token_logprobs(model_lib.merge(_CFG, params), tokens, prompt_lengths,
                                     lengths, seeds, seed=0, mask_id=3, p_mask_prompt=p)))
    self._elbo = jax.jit(lambda params, tokens, prompt_lengths, lengths, seeds: (
        estimators.sequence_elbo(model_lib.merge(_CFG, params), tokens, prompt_lengths, lengths,
                                 seeds, seed=0, mask_id=3, num_samples=2)))
    self._forward = jax.jit(lambda params, tokens, lengths: model_lib.merge(_CFG, params)(
        tokens, valid_length_B=lengths))

  def d1(self, *args, p_mask_prompt):
    return np.asarray(self._d1(self.params, *args, jnp.float32(p_mask_prompt)))

  def elbo(self, *args):
    return np.asarray(self._elbo(self.params, *args))

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
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  out = np.zeros(len(tokens))
  out[prompt_len:length] = logp[np.arange(prompt_len, length), tokens[prompt_len:length]]
  return out


def test_d1_logprobs_match_a_direct_forward(module):
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 100, (2, 12)).astype(np.int32)
  prompt_lengths, lengths = np.array([3, 5]), np.array([10, 12])
  logp = module.d1(jnp.asarray(tokens), jnp.asarray(prompt_lengths), jnp.asarray(lengths),
                   jnp.array([7, 8]), p_mask_prompt=0.0)
  for b in range(2):
    np.testing.assert_allclose(logp[b], _reference(module, tokens[b], prompt_lengths[b],
                                                   lengths[b], 3), rtol=2e-4, atol=2e-4)


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
  np.testing.assert_allclose(full, module.d1(jnp.asarray(masked_prompt), *args[1:], jnp.arange(2),
                                             p_mask_prompt=0.0), rtol=1e-5, atol=1e-5)


def test_sequence_elbo_uses_shared_masks(module):
  tokens = jnp.asarray(np.random.default_rng(2).integers(4, 100, (2, 12)), jnp.int32)
  args = (tokens, jnp.array([4, 4]), jnp.array([12, 12]))
  a = module.elbo(*args, jnp.array([1, 2]))
  b = module.elbo(*args, jnp.array([1, 2]))
  np.testing.assert_array_equal(a, b)
  assert a.shape == (2,) and np.all(np.asarray(a) < 0)
