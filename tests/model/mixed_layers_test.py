"""MoE models whose layers mix dense and MoE feed-forwards (model.moe.dense_layers).

The model holds one scanned Block per run of layers of one kind (ModelConfig.layer_runs); these
tests compose the same layers by hand, one unstacked Block at a time, and check the forward, the
scan, the router statistics (MoE layers only), the train step, the sampler's K/V caches, the
counts and the config's refusals.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax import summary
from dlmjax.model import moe, moe_stats, transformer
from dlmjax.train import memory
from tests.conftest import tiny_test_config
from tests.diffusion import tiny_sampler
from tests.model.moe_test import TINY_MOE

# 5 layers: dense, MoE, dense, dense, MoE -> runs blocks (0), blocks_1 (1), blocks_2 (2, 3),
# blocks_3 (4): a run of two scanned layers and MoE layers in two stacks.
MIXED = {
  **TINY_MOE,
  'model.num_layers': 5,
  'model.moe.dense_layers': '0,2,3',
  'model.init_std': 0.3,
}
TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)


def _model(**overrides):
  cfg = model_lib.ModelConfig.from_config(tiny_test_config(**{**MIXED, **overrides}))
  return cfg, model_lib.init_params(cfg, jax.random.key(0))


def _by_hand(cfg, params, tokens, order=None):
  """The embedding, then each layer (its slice of its run's stack, in an unstacked Block of its
  kind) in `order` (default: 0, 1, ...), the final norm and the head."""
  module = model_lib.merge(cfg, params)
  x = jnp.take(params['embed_tokens'], tokens, axis=0)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  for i in order or range(cfg.num_layers):
    key, j = cfg.layer_location(i)
    kind = cfg.is_moe_layer(i)
    block = nnx.eval_shape(lambda k=kind: transformer.Block(cfg, rngs=nnx.Rngs(0), moe_mlp=k))
    graphdef, _ = nnx.split(block)
    layer = nnx.merge(graphdef, jax.tree.map(lambda p, j=j: p[j], params[key]))
    x = layer(x, positions, kind='bidirectional', block_size=cfg.block_size, backend='xla')[0]
  return module.logits(module.final_norm(x))


def test_layer_runs_keep_the_tree_of_models_of_one_kind():
  cfg, params = _model()
  assert [r[:2] for r in cfg.layer_runs()] == [
    ('blocks', False),
    ('blocks_1', True),
    ('blocks_2', False),
    ('blocks_3', True),
  ]
  assert params['blocks_2']['mlp']['gate_proj'].shape == (2, 16, 32)  # dense: ffn_dim
  assert params['blocks_3']['mlp']['gate_proj'].shape == (1, 4, 16, 16)  # experts: moe_ffn_dim
  for dense in ('', None):  # all MoE, and all dense: the one `blocks` stack as before
    overrides = {'model.moe.dense_layers': ''} if dense == '' else {'model.moe.num_experts': 0}
    one = model_lib.ModelConfig.from_config(tiny_test_config(**{**MIXED, **overrides}))
    _, shapes, _ = model_lib.abstract(one)
    assert [k for k in shapes if k.startswith('blocks')] == ['blocks']
    assert jax.tree.leaves(shapes['blocks'])[0].shape[0] == 5


def test_forward_is_the_layers_composed_by_hand_in_order_scanned_or_not():
  cfg, params = _model()
  want = jax.jit(lambda p: _by_hand(cfg, p, TOKENS))(params)
  for scan in (True, False):
    c = dataclasses.replace(cfg, scan_layers=scan, remat='full' if scan else 'none')
    got = jax.jit(lambda p, c=c: model_lib.merge(c, p)(TOKENS))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The check can fail: the same layers in another order (a dense and an MoE layer swapped).
  other = jax.jit(lambda p: _by_hand(cfg, p, TOKENS, order=[1, 0, 2, 3, 4]))(params)
  assert np.abs(other - want).max() > 1e-2


def test_router_statistics_and_losses_count_the_moe_layers_only():
  cfg, params = _model()

  def loss(p):
    with moe_stats.collect() as calls:
      logits = model_lib.merge(cfg, p)(TOKENS)
    return jnp.mean(jnp.square(logits)) + moe_stats.summarize(calls)['balance_loss'], calls

  (_, calls), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  (stats,) = calls
  assert stats['counts'].shape == (2, 4)  # layers 1 and 4
  # Every token's experts_per_token choices in each of the two MoE layers, none in dense ones.
  np.testing.assert_array_equal(stats['counts'].sum(axis=1), [TOKENS.size * 2] * 2)
  assert stats['balance_loss'].shape == (2,)
  for key in ('blocks_1', 'blocks_3'):  # the balance loss reaches both MoE stacks' routers
    assert np.any(grads[key]['mlp']['router_kernel'])


def test_train_step_runs_and_loss_free_balancing_moves_both_moe_stacks():
  from tests.train.step_test import run_steps  # pylint: disable=import-outside-toplevel

  config = tiny_test_config(  # MoE, dense, MoE: two MoE stacks, one step compile of 3 layers
    **{
      **MIXED,
      'model.num_layers': 3,
      'model.moe.dense_layers': '1',
      'train.global_batch_size': 8,
      'model.moe.router': 'sigmoid_bias',
      'model.moe.balance_loss': 0.01,
      'model.moe.bias_rate': 0.01,
      'mesh.fsdp': 1,
    }
  )
  losses, state = run_steps(config, num_steps=2)
  assert np.all(np.isfinite(losses))
  params = state['params']
  for key in ('blocks', 'blocks_2'):
    assert np.any(np.asarray(params[key]['mlp'][moe.BIAS]) != 0), key
  assert moe.BIAS not in params['blocks_1']['mlp']


def test_cached_slice_forward_covers_every_layer_in_order():
  """hidden_kv's K/V stack all 5 layers in order, and a slice attending to them gives the whole
  forward's logits (the sampler's dual cache); the block cache decodes as no cache does."""
  cfg, params = _model(**{'model.vocab_size': 128, 'model.seq_len': 32})
  tokens, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16)
  start = width + 8

  @jax.jit
  def run(params):
    module = model_lib.merge(cfg, params)
    full = module(tokens, segment_ids_BL=segments, positions_BL=positions)
    _, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
    dual, _ = tiny_sampler.slice_logits(module, tokens, segments, positions, kv, start, 8)
    return full, dual, kv

  full, dual, kv = run(params)
  assert kv[0].shape[0] == 5
  np.testing.assert_allclose(dual, full[:, start : start + 8], atol=1e-4)

  causal, params = _model(
    **{'model.vocab_size': 128, 'model.seq_len': 32, 'model.attention_mask': 'causal'}
  )
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache='block')
  got, want = tiny_sampler.cached_and_uncached(causal, params, sampling)
  np.testing.assert_array_equal(got, want)


def test_counts_summary_and_memory_treat_dense_layers_as_dense():
  config = tiny_test_config(**MIXED)
  cfg = model_lib.ModelConfig.from_config(config)
  d, v = 16, cfg.vocab_size
  attn = d * 8 * (2 * 2 + 2 * 2) + 2 * 8 + 2 * d  # q, k, v, o, q/k norms, the two layer norms
  dense, experts, router = 3 * d * 32, 3 * d * 16, d * 4
  embed = v * d * (1 if cfg.tie_embeddings else 2) + d  # + the final norm
  assert cfg.num_params() == 5 * attn + 3 * dense + 2 * (4 * experts + router) + embed
  assert cfg.num_params(active=True) == 5 * attn + 3 * dense + 2 * (2 * experts + router) + embed
  assert cfg.num_expert_params() == 2 * 4 * experts
  _, shapes, _ = model_lib.abstract(cfg)
  assert sum(np.prod(s.shape) for s in jax.tree.leaves(shapes)) == cfg.num_params()
  text = summary.summarize(config, 1)
  assert 'experts: 4 per MoE layer of width 16' in text
  assert 'dense layers (indices): 0,2,3 of 5 layers (an MLP of ffn_dim 32); 2 MoE layers' in text
  assert f'active parameters per token: {cfg.num_params(active=True):,}' in text

  def activations(**overrides):
    c = tiny_test_config(**{**MIXED, 'model.ffn_dim': 64, **overrides})  # dense f 64, MoE 2 x 16
    config_lib.fit_to_devices(c, 1)
    return memory.estimate_bytes_per_device(c)['activations']

  all_dense, all_moe = (
    activations(**{'model.moe.num_experts': 0, 'model.moe.dense_layers': ''}),
    activations(**{'model.moe.dense_layers': ''}),
  )
  assert all_dense > all_moe
  np.testing.assert_allclose(activations(), (3 * all_dense + 2 * all_moe) / 5)


@pytest.mark.parametrize(
  'overrides,match',
  [
    ({'model.moe.dense_layers': '0,5'}, r'names layers \[5\] outside \[0, model.num_layers=5\)'),
    (
      {'model.moe.num_experts': 0},
      "model.moe.num_experts=0.*set --config.model.moe.dense_layers=''",
    ),
    ({'model.moe.dense_layers': '0,1,2,3,4'}, 'makes every layer dense'),
    ({'model.moe.dense_layers': 'first'}, 'is not comma-separated layer indices'),
  ],
)
def test_bad_dense_layers_are_refused_in_one_line(overrides, match):
  config = tiny_test_config(**{**MIXED, **overrides})
  with pytest.raises(config_lib.ConfigError, match=match) as e:
    config_lib.validate(config, 1)
  assert '\n' not in str(e.value)


def test_pipeline_stages_refuse_a_mixed_model():
  cfg, params = _model()
  staged = dataclasses.replace(cfg, pipeline_stages=2)
  with pytest.raises(ValueError, match='model.pipeline_stages=1'):
    model_lib.merge(staged, params)(TOKENS)
