"""LLaDA2.2's block routing (model.moe.block_experts) against the rule written out in numpy: per
block of block_size positions the C experts of the highest best selection score over its tokens
form the pool, and each token takes its top-k inside the pool (model/moe.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlmjax.model import moe

D, E, K, F = 16, 8, 2, 8
BLOCK = 4


def _layer(router, pool, groups=1, group_topk=1):
  layer = moe.MoE(
    D,
    E,
    K,
    F,
    router=router,
    shared_ffn_dim=0,
    router_groups=groups,
    router_group_topk=group_topk,
    routed_scale=2.5,
    std=0.5,
    out_std=0.3,
    rngs=nnx.Rngs(0),
    block_experts=pool,
    block_size=BLOCK,
  )
  if router == 'sigmoid_bias':  # a bias that changes the choice
    getattr(layer, moe.BIAS).value = jnp.linspace(-0.3, 0.3, E)
  return layer


def _reference_weights(layer, x_BLD, pool):
  """[B, L, E] routed weights by the rule, token by token in numpy."""
  logits = np.einsum('bld,de->ble', np.asarray(x_BLD), np.asarray(layer.router_kernel.value))
  if layer.router == 'sigmoid_bias':
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + np.asarray(getattr(layer, moe.BIAS).value)
  else:
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores = choice = scores / scores.sum(-1, keepdims=True)
  if layer.groups > 1:  # a token's experts outside its best groups (two best summed) are out
    choice = choice.copy()
    for b, i in np.ndindex(*choice.shape[:2]):
      grouped = choice[b, i].reshape(layer.groups, -1)
      group_score = np.sort(grouped, -1)[:, -2:].sum(-1)
      dropped = np.argsort(-group_score, kind='stable')[layer.group_topk :]
      grouped[dropped] = -np.inf
  out = np.zeros(scores.shape)
  batch, length, _ = scores.shape
  for b in range(batch):
    for first in range(0, length, BLOCK):
      rows = range(first, min(first + BLOCK, length))
      best = np.max(choice[b, first : first + BLOCK], axis=0)
      admitted = np.argsort(-best, kind='stable')[:pool]
      for i in rows:
        ranked = sorted(admitted, key=lambda e: -choice[b, i, e])[:K]
        chosen = [e for e in ranked if np.isfinite(choice[b, i, e])]
        w = scores[b, i, chosen]
        if layer.router != 'softmax_topk_raw':
          w = w / w.sum()
        out[b, i, chosen] = 2.5 * w
  return out


def _routed(layer, x_BLD):
  graphdef, state = nnx.split(layer)

  @jax.jit
  def dense_weights(state, x):
    experts, weights, _ = nnx.merge(graphdef, state).route(x)
    return jnp.sum(jax.nn.one_hot(experts, E) * weights[..., None], axis=-2)

  return np.asarray(dense_weights(state, x_BLD))


@pytest.mark.parametrize(
  'router,groups,group_topk', [('sigmoid_bias', 4, 2), ('softmax_topk', 1, 1)]
)
def test_block_routing_matches_the_written_out_rule(router, groups, group_topk):
  # 10 positions: two whole blocks of 4 and a partial one; a pool of 3 of the 8 experts.
  x = jax.random.normal(jax.random.key(3), (2, 10, D))
  layer = _layer(router, 3, groups, group_topk)
  got = _routed(layer, x)
  np.testing.assert_allclose(got, _reference_weights(layer, x, 3), rtol=1e-5, atol=1e-6)
  for first in range(0, 10, BLOCK):  # the block's working set is at most C experts ...
    used = np.any(got[:, first : first + BLOCK] > 0, axis=1).sum(-1)
    assert np.all(used <= 3)
  # ... and block routing changes which experts run (else the test would not see the pool).
  token_routed = _routed(_layer(router, 0, groups, group_topk), x)
  assert np.any(np.any(token_routed[:, :BLOCK] > 0, axis=1).sum(-1) > 3)


def test_dispatch_runs_only_the_pool():
  """Every (token, choice) the grouped matmul runs, weight-0 choices included, is in its
  block's pool: a token whose kept groups hold fewer than k pool experts must not send its empty
  choices to experts outside (their weights would be read for nothing)."""
  x = jax.random.normal(jax.random.key(3), (2, 10, D))
  layer = _layer('sigmoid_bias', 3, 4, 2)
  graphdef, state = nnx.split(layer)
  experts, weights, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s).route(x))(state, x)
  experts, weights = np.asarray(experts), np.asarray(weights)
  assert np.any(weights == 0)  # the case this guards: some token has an empty choice
  pool = _reference_weights(layer, x, 3) > 0
  for first in range(0, 10, BLOCK):
    for b in range(2):
      admitted = set(np.flatnonzero(pool[b, first : first + BLOCK].any(0)))
      assert set(experts[b, first : first + BLOCK].ravel()) <= admitted


def test_a_pool_of_every_expert_is_token_routing_and_the_layer_runs_the_pool():
  x = jax.random.normal(jax.random.key(4), (1, 8, D))
  full, token = _layer('sigmoid_bias', E, 4, 2), _layer('sigmoid_bias', 0, 4, 2)
  np.testing.assert_allclose(_routed(full, x), _routed(token, x), rtol=1e-6)
  # The forward runs the routed weights: equal to the experts' dense sum weighted by them.
  layer = _layer('sigmoid_bias', 3, 4, 2)
  weights = jnp.asarray(_reference_weights(layer, x, 3), jnp.float32)
  gate = jnp.einsum('bld,edf->blef', x, layer.gate_proj.value)
  up = jnp.einsum('bld,edf->blef', x, layer.up_proj.value)
  every = jnp.einsum('blef,efd->bled', jax.nn.silu(gate) * up, layer.down_proj.value)
  graphdef, state = nnx.split(layer)
  out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x)
  np.testing.assert_allclose(out, jnp.einsum('bled,ble->bld', every, weights), atol=1e-5)


def test_a_pool_smaller_than_k_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r'block_experts=1 must lie in \[experts_per_token=2'):
    _layer('sigmoid_bias', 1)
