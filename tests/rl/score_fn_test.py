"""The rollout scorer (rollout.make_score_fn): the run's seed is an argument of its program, so
runs that differ only in their seed share one compilation and each gets its own masks."""

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.rl import estimators, rollout
from tests.conftest import tiny_test_config


def _config(seed):
  return tiny_test_config(
    **{'seed': seed, 'model.seq_len': 16, 'rl.objective': 'd1', 'rl.p_mask_prompt': 0.5}
  )


def _baked(cfg, config):
  """The former program: the seed a constant of the compiled function."""
  return jax.jit(
    lambda params, tokens, prompt_lengths, lengths, seeds: estimators.d1_token_logprobs(
      model_lib.merge(cfg, params),
      tokens,
      prompt_lengths,
      lengths,
      seeds,
      seed=config.seed,
      mask_id=config.model.mask_token_id,
      p_mask_prompt=config.rl.p_mask_prompt,
      chunk_size=config.model.loss_chunk_tokens,
    )
  )


def test_two_seeds_share_one_compilation_and_score_as_the_seed_baked_in():
  cfg = model_lib.ModelConfig.from_config(_config(0))
  params = jax.jit(lambda key: model_lib.init_params(cfg, key))(jax.random.key(0))
  rng = np.random.default_rng(0)
  args = (
    params,
    rng.integers(4, 200, (2, 16)).astype(np.int32),
    np.array([5, 7], np.int32),
    np.array([16, 12], np.int32),
    np.arange(2, dtype=np.int32),
  )
  scores, program = {}, None
  for seed in (11, 12):
    config = _config(seed)
    score = rollout.make_score_fn(config, cfg)
    scores[seed] = np.asarray(score(*args))
    if program is None:
      program, compiled = score.func, score.func._cache_size()  # pylint: disable=protected-access
    assert score.func is program and score.func._cache_size() == compiled  # no second compile
    np.testing.assert_array_equal(scores[seed], np.asarray(_baked(cfg, config)(*args)))
  assert np.abs(scores[11] - scores[12]).max() > 1e-4  # the seed does reach the masks
