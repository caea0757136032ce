"""Scoring programs' params: a bfloat16-stored model computes as its float32 upcast does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.model import programs
from tests.model import transformer_test

CFG = transformer_test.CFG
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_dim=16, shared_experts=1, dense_layers=(0,))


def _upcast_all(params):
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
  )


@pytest.mark.parametrize(
  'dtype,extra',
  [('bfloat16', {}), ('float32', {}), ('bfloat16', MOE), ('bfloat16', dict(score_head=True))],
  ids=['bf16', 'f32', 'bf16-moe', 'bf16-score-head'],
)
def test_stored_bfloat16_params_score_as_their_float32_upcast_without_a_copy(dtype, extra):
  cfg = dataclasses.replace(CFG, dtype=dtype, **extra)
  stored = jax.tree.map(
    lambda x: x.astype(jnp.bfloat16), model_lib.init_params(cfg, jax.random.key(0))
  )
  tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab_size)

  @jax.jit
  def run(params):
    module = model_lib.merge(cfg, params)
    return module.scores(tokens, pad_id=0) if cfg.score_head else module(tokens)

  kept = programs.as_float32_params(stored, cfg.matmul_dtype)
  np.testing.assert_array_equal(run(kept), run(_upcast_all(stored)))
  # No float32 copy of a bfloat16 weight (the memory this saves): kept is the stored tree.
  assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(stored)))


def test_fp8_matmuls_read_float32_params():
  stored = {'w_proj': jnp.ones((2, 2), jnp.bfloat16), 'ids': jnp.ones(2, jnp.int32)}
  out = programs.as_float32_params(stored, 'fp8')
  assert out['w_proj'].dtype == jnp.float32 and out['ids'].dtype == jnp.int32
