"""The MoE layer against a dense reference: every expert run on every token, masked by the
router's choice; forward and gradient, for each router."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlmjax.model import moe, moe_stats

D, E, K, F = 16, 4, 2, 16

# The smallest transformer the MoE tests build (d_model 16, vocab 64): compiles stay seconds.
TINY_MOE = {
  'model.moe.num_experts': 4,
  'model.moe.experts_per_token': 2,
  'model.moe.ffn_dim': 16,
  'model.d_model': 16,
  'model.num_heads': 2,
  'model.num_kv_heads': 2,
  'model.head_dim': 8,
  'model.ffn_dim': 32,
  'model.vocab_size': 64,
  'model.seq_len': 8,
}


def _layer(router, shared=0):
  return moe.MoE(
    D, E, K, F, router=router, shared_ffn_dim=shared, std=0.3, out_std=0.3, rngs=nnx.Rngs(0)
  )


def _dense_reference(layer, x_BLD):
  """sum_e mask[t, e] * w[t, e] * Expert_e(x[t]), the router's choice from scratch."""
  logits = jnp.einsum('bld,de->ble', x_BLD, layer.router_kernel.value)
  if layer.router == 'sigmoid_bias':
    scores = jax.nn.sigmoid(logits)
    chosen = jax.lax.top_k(scores + getattr(layer, moe.BIAS).value[None, None, :], K)[1]
    mask = jax.nn.one_hot(chosen, E).sum(-2)
    weights = scores * mask / jnp.sum(scores * mask, -1, keepdims=True)
  else:
    p = jax.nn.softmax(logits, -1)
    mask = jax.nn.one_hot(jax.lax.top_k(p, K)[1], E).sum(-2)
    weights = p * mask
    if layer.router == 'softmax_topk':
      weights = weights / jnp.sum(weights, -1, keepdims=True)
  gate = jnp.einsum('bld,edf->blef', x_BLD, layer.gate_proj.value)
  up = jnp.einsum('bld,edf->blef', x_BLD, layer.up_proj.value)
  every_BLED = jnp.einsum('blef,efd->bled', jax.nn.silu(gate) * up, layer.down_proj.value)
  out = jnp.einsum('bled,ble->bld', every_BLED, weights)
  if hasattr(layer, 'shared'):
    out = out + layer.shared(x_BLD)
  return out


@pytest.mark.parametrize(
  'router,shared', [('softmax_topk', 0), ('softmax_topk_raw', 0), ('sigmoid_bias', 1)]
)
def test_dispatch_matches_the_dense_reference_forward_and_gradient(router, shared):
  layer = _layer(router, shared * F)
  if router == 'sigmoid_bias':  # a bias that changes the choice
    getattr(layer, moe.BIAS).value = jnp.linspace(-0.5, 0.5, E)
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), (2, 4, D))

  def loss(state, x, fn):
    out = fn(nnx.merge(graphdef, state), x)
    return jnp.sum(jnp.sin(out)), out

  def both(state, x):
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return grad(state, x, lambda m, x: m(x)[0]), grad(state, x, _dense_reference)

  ((_, got), g_got), ((_, want), g_want) = jax.jit(both)(state, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  if router == 'sigmoid_bias':  # selection only: no gradient reaches the bias
    assert not np.any(g_got[0]['router_bias'].value)


def test_statistics_count_every_assignment_and_balance_loss_is_k_when_uniform():
  layer = _layer('softmax_topk')
  x = jax.random.normal(jax.random.key(2), (2, 3, D))
  graphdef, state = nnx.split(layer)
  stats_of = jax.jit(lambda state, x: moe_stats.layer_stats(nnx.merge(graphdef, state).route(x)[2]))
  stats = stats_of(state, x)
  assert float(stats['counts'].sum()) == 2 * 3 * K
  # A zero router: every probability 1/E, so the loss is E * sum_e f_e / E = k.
  state['router_kernel'].value = jnp.zeros_like(state['router_kernel'].value)
  stats = stats_of(state, x)
  np.testing.assert_allclose(stats['balance_loss'], K, rtol=1e-6)
  np.testing.assert_allclose(stats['entropy'], np.log(E), rtol=1e-6)
  np.testing.assert_allclose(stats['z_loss'], np.log(E) ** 2, rtol=1e-6)


def test_statistics_of_a_split_batch_summed_are_the_whole_batch_statistics():
  """The pipeline's micro-batches add their layer_sums before layer_stats forms the losses: the
  same numbers as the whole batch in one piece (the balance loss is not a mean of the pieces')."""
  layer = _layer('softmax_topk')
  x = jax.random.normal(jax.random.key(3), (4, 3, D))
  graphdef, state = nnx.split(layer)
  sums_of = jax.jit(lambda state, x: nnx.merge(graphdef, state).route(x)[2])
  pieces = [sums_of(state, x[i::2]) for i in range(2)]
  got = moe_stats.layer_stats(jax.tree.map(lambda *a: sum(a), *pieces))
  want = moe_stats.layer_stats(sums_of(state, x))
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
  split = np.mean([moe_stats.layer_stats(p)['balance_loss'] for p in pieces])
  assert abs(split - want['balance_loss']) > 1e-4  # averaging the pieces' losses would differ


def test_balance_bias_moves_toward_the_underloaded_experts():
  params = {'blocks': {'mlp': {moe.BIAS: jnp.zeros((2, 4))}}}
  counts = jnp.array([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
  new = moe.balance_bias(params, counts, 0.1)['blocks']['mlp'][moe.BIAS]
  np.testing.assert_allclose(new, [[-0.1, 0.1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_bad_top_k_names_the_fix():
  with pytest.raises(ValueError, match='experts_per_token=9 must be in'):
    moe.MoE(D, E, 9, F, router='softmax_topk', shared_ffn_dim=0, std=1, out_std=1, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  'preset,total,active',
  [
    # Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
    ('qwen3_30b_a3b', 30_532_122_624, 3_353_032_704),
    # LLaDA-MoE-7B-A1B (families_and_decoding.md): 7B total, 1.4B active in the paper; the sum
    # of its tensors with vocab 157184 is 7.36B and 1.72B active (1.08B without the embeddings).
    ('llada_moe_7b_a1b', 7_356_880_896, 1_719_736_320),
  ],
)
def test_moe_presets_have_the_published_total_and_active_counts(preset, total, active):
  from dlmjax import config as config_lib
  from dlmjax import model as model_lib

  config = config_lib.defaults()
  model_lib.apply_preset(config.model, preset)
  config_lib.validate(config)
  cfg = model_lib.ModelConfig.from_config(config)
  assert (cfg.num_params(), cfg.num_params(active=True)) == (total, active)
  assert round(total / 1e9, 1) == {'qwen3_30b_a3b': 30.5, 'llada_moe_7b_a1b': 7.4}[preset]
  if preset == 'llada_moe_7b_a1b':
    non_embedding_active = active - 2 * cfg.vocab_size * cfg.d_model
    assert round(non_embedding_active / 1e9, 2) == 1.08
  else:
    assert round(active / 1e9, 1) == 3.4  # 3.35B, the card's "3.3B" rounded down


@pytest.mark.parametrize('router,shared', [('softmax_topk', 0), ('sigmoid_bias', 2)])
def test_moe_param_count_matches_the_tree(router, shared):
  from dlmjax import model as model_lib
  from tests.conftest import tiny_test_config

  config = tiny_test_config(
    **{'model.moe.num_experts': 4, 'model.moe.router': router, 'model.moe.shared_experts': shared}
  )
  cfg = model_lib.ModelConfig.from_config(config)
  _, shapes, _ = model_lib.abstract(cfg)
  assert sum(np.prod(s.shape) for s in jax.tree.leaves(shapes)) == cfg.num_params()
  assert cfg.num_params(active=True) < cfg.num_params()


def test_moe_transformer_gradient_is_the_same_scanned_or_unrolled_with_or_without_remat():
  """The stacked layers' statistics and the experts' saved activations (remat names) change
  nothing: scan + save_activations and an unrolled stack without remat give one gradient."""
  import dataclasses

  from dlmjax import model as model_lib
  from tests.conftest import tiny_test_config

  config = tiny_test_config(**TINY_MOE)  # 2 layers: the scan stacks two layers' statistics
  base = model_lib.ModelConfig.from_config(config)
  params = model_lib.init_params(base, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)

  def grads(cfg):
    def loss(p):
      with moe_stats.collect() as calls:
        logits = model_lib.merge(cfg, p)(tokens)
      return jnp.mean(jnp.square(logits)) + moe_stats.summarize(calls)['balance_loss']

    return jax.jit(jax.grad(loss))(params)

  scanned = grads(dataclasses.replace(base, scan_layers=True, remat='save_activations'))
  unrolled = grads(dataclasses.replace(base, scan_layers=False, remat='none'))
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  assert np.any(scanned['blocks']['mlp']['router_kernel'])  # the balance loss reaches the router
