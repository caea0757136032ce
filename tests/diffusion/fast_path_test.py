"""The fast path (generate's program: weights cast once, q / k / v and gate / up fused, the cache
mode's strategy) against plain reference loops on the same weights, CPU, float32: Fast-dLLM's
prefix and dual cache loops written out (decode_references), where the caches are approximate;
LoRA adapters (unmerged and merged) and int8 / NF4 bases through the same loops.
docs/benchmarks.md, Sampler, "What the tests hold" maps every mode and family to its test."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.model import lora
from tests.diffusion import tiny_sampler
from tests.diffusion.decode_references import PlainCache, llada_reference

# 2 blocks of 8, 4 steps per block: 3 cached steps of every 4.
BASE = tiny_sampler.CACHE_BASE
DREAM = (('model.shift_logits', True), ('model.qkv_bias', True), ('model.qk_norm', False))
_ALL = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
DUAL_CFG = dataclasses.replace(BASE, cache='dual', cache_refresh=2, cfg_scale=0.5)


@functools.lru_cache
def _model(options=(), adapters=None):
  """(ModelConfig, params, PlainCache): a bidirectional tiny model; adapters = (weight_quant,
  targets) adds rank-2 LoRA adapters with random (non-zero) A and B over a base stored so."""
  model_config, params = tiny_sampler.model(**dict(options))
  if adapters is not None:
    quant, targets = adapters
    model_config = dataclasses.replace(
      model_config, lora_rank=2, lora_alpha=4.0, lora_targets=targets, weight_quant=quant
    )
    shapes = lora.split(model_lib.abstract(model_config)[1])[0]
    keys = iter(jax.random.split(jax.random.key(7), 64))
    random = jax.tree.map(lambda s: 0.3 * jax.random.normal(next(keys), s.shape), shapes)
    params = lora.combine(random, lora.freeze(params, model_config, jnp.float32))
  return model_config, params, PlainCache(model_config, params)


def _reference(model, s):
  whole = lambda *a: model[2].refresh(*a)[0]  # noqa: E731
  return llada_reference(whole, tiny_sampler.PROMPTS, s, cache=model[2])[0]


@pytest.mark.parametrize(
  'mode,changes,options',
  [
    ('prefix', {}, ()),
    ('dual', dict(cache_refresh=2, cfg_scale=0.5), ()),  # a mid-block refresh; CFG (DUAL_CFG)
    ('dual', dict(factor=1.0), ()),  # Fast-dLLM's eval setting: dual cache, factor 1
    # Dream-style shifted model: slices start one position early (the reference loop spreads
    # LLaDA's counts; Dream's own schedule is sampler_test's, on the same fast path).
    ('prefix', dict(threshold=0.3, schedule='linear'), DREAM),
  ],
  ids=['prefix', 'dual_refresh2_cfg', 'dual_factor', 'prefix_threshold_dream'],
)
def test_approximate_caches_decode_fast_dllms_loop(mode, changes, options):
  """Token for token the written-out Fast-dLLM loop on the plain model, in settings where the
  cache's approximation shows: the same loop with every step a whole forward (none) decodes
  other tokens."""
  model = _model(options)
  s = dataclasses.replace(BASE, cache=mode, **changes)
  got = tiny_sampler.generate(*model[:2], s)
  want = _reference(model, s)
  np.testing.assert_array_equal(got, want)
  assert not (got == tiny_sampler.MASK).any()
  exact = _reference(model, dataclasses.replace(s, cache='none', cache_refresh=0))
  assert (want != exact).any()  # the test tells the approximation from the exact loop


@pytest.mark.parametrize(
  'quant,targets',
  [('none', _ALL), ('int8', ('q', 'v', 'up')), ('nf4', ('k', 'gate', 'o'))],
  ids=['lora', 'int8_lora', 'nf4_lora'],
)
def test_adapters_and_quantised_bases_decode_the_plain_loops_tokens(quant, targets):
  """Unmerged LoRA adapters on a float32, int8 or NF4 base: the fast path (each part's adapter
  added to its slice of the fused product) decodes the plain model's tokens, dual cache, CFG
  and a mid-block refresh included; the adapters change them. Merged into the float base, the
  same tokens."""
  model = _model(adapters=(quant, targets))
  s = DUAL_CFG  # the merged model's program is test_approximate_caches_decode_fast_dllms_loop's
  got = tiny_sampler.generate(*model[:2], s)
  want = _reference(model, s)
  np.testing.assert_array_equal(got, want)
  model_config, params, cache = model
  if quant == 'none':
    merged = lora.merge_into_base(params, model_config.lora_spec)
    np.testing.assert_array_equal(tiny_sampler.generate(_model()[0], merged, s), want)
  adapters, base = lora.split(params)
  off = lora.combine(jax.tree.map(jnp.zeros_like, adapters), base)  # B = 0: the base alone
  assert (_reference((model_config, off, cache.with_params(off)), s) != want).any()
