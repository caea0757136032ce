"""The sampler's K/V caches: `block` token for token against `none` (exact), `prefix` / `dual`
against `none` where Fast-dLLM's approximation is exact, and the cached slice forward against a
whole-canvas recomputation."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler_programs
from dlmjax.model import attention
from dlmjax.parallel import mesh as mesh_lib
from tests.conftest import tiny_test_config
from tests.diffusion import tiny_sampler


# Dream's options (q/k/v biases, no QK-norm, token i predicted at position i-1).
DREAM = (('model.shift_logits', True), ('model.qkv_bias', True), ('model.qk_norm', False))


@functools.lru_cache
def _models(kind, scan=True, options=()):
  overrides = {'model.attention_mask': kind, 'model.scan_layers': scan, **dict(options)}
  if kind == 'block_causal':
    overrides['model.block_size'] = 4
  return tiny_sampler.model(**overrides)


def test_cached_slice_forward_equals_the_whole_canvas_forward(scan=True):
  """Dual (the block alone) and prefix (block and suffix) slices attending to K/V of the same
  canvas give the whole forward's logits, and hand back the same K/V for their positions."""
  model_config, params = _models('bidirectional', scan)
  tokens, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16)
  start = width + 8

  @jax.jit
  def run(params, tokens):
    module = model_lib.merge(model_config, params)
    full = module(tokens, segment_ids_BL=segments, positions_BL=positions)
    hidden, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
    dual, dual_kv = tiny_sampler.slice_logits(module, tokens, segments, positions, kv, start, 8)
    prefix, _ = tiny_sampler.slice_logits(module, tokens, segments, positions, kv, width, 16)
    return full, module.logits(hidden), dual, prefix, kv, dual_kv

  full, with_kv, dual, prefix, kv, dual_kv = run(params, tokens)
  np.testing.assert_allclose(with_kv, full, atol=1e-5)
  np.testing.assert_allclose(dual, full[:, start : start + 8], atol=1e-4)
  np.testing.assert_allclose(prefix, full[:, width:], atol=1e-4)
  assert kv[0].shape == (2, len(tiny_sampler.PROMPTS), tokens.shape[1], 2, 16)
  for kept, returned in zip(kv, dual_kv):
    assert returned.shape == (2, len(tiny_sampler.PROMPTS), 8, 2, 16)
    np.testing.assert_allclose(returned, kept[:, :, start : start + 8], atol=1e-5)


@pytest.mark.parametrize('scan', [True, False])
def test_fresh_block_kv_replace_stale_ones(scan):
  """After the block's tokens change, a causal model's cached block forward (prefix K/V kept,
  the block's recomputed) equals the whole forward of the new canvas: stale block K/V would not."""
  model_config, params = _models('causal', scan)
  old, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16, seed=0)
  new = old.at[:, width + 8 :].set(
    tiny_sampler.canvas(tiny_sampler.PROMPTS, 16, seed=1)[0][:, width + 8 :]
  )
  start = width + 8

  @jax.jit
  def run(params, old, new):
    module = model_lib.merge(model_config, params)
    _, kv = module.hidden_kv(old, positions_BL=positions, segment_ids_BL=segments)
    return (
      module(new, segment_ids_BL=segments, positions_BL=positions)[:, start : start + 8],
      tiny_sampler.slice_logits(module, new, segments, positions, kv, start, 8)[0],
      module(old, segment_ids_BL=segments, positions_BL=positions)[:, start : start + 8],
    )

  want, got, stale = run(params, old, new)
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert np.abs(stale - want).max() > 1e-2  # the canvases differ where it matters.


@pytest.mark.parametrize(
  'kind,changes',
  [
    # Margin orders by the tempered, top-p distribution. With low_confidence at these settings
    # XLA's CPU build on AVX-512 hosts commits a token outside the nucleus in `none` itself
    # (eager and --xla_cpu_max_isa=SSE4_2 agree with the cache), so that pair cannot be compared.
    ('causal', dict(cfg_scale=1.5, temperature=0.7, top_p=0.9, remasking='margin')),
    ('causal', dict(threshold=0.3, remasking='random', stop_at_eos=True)),
    ('block_causal', dict(cfg_scale=0.5, threshold=0.3)),
    # Prompts of 7 tokens at most: the prefill is shorter than a block.
    ('causal', dict(prompts=tiny_sampler.PROMPTS[:5])),
  ],
)
def test_block_cache_is_token_identical_to_none(kind, changes):
  model_config, params = _models(kind)
  prompts = changes.pop('prompts', tiny_sampler.PROMPTS)
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache='block', **changes)
  sampled = sampling.temperature > 0  # bit-identical logits needed: XLA's default emitters
  with tiny_sampler.default_cpu_emitters() if sampled else contextlib.nullcontext():
    got, want = tiny_sampler.cached_and_uncached(model_config, params, sampling, prompts=prompts)
  np.testing.assert_array_equal(got, want)
  assert not (got == tiny_sampler.MASK).any()


@pytest.mark.parametrize(
  'mode,sampling',
  [
    (
      'prefix',
      dataclasses.replace(tiny_sampler.CACHE_BASE, cache_refresh=1),
    ),  # refreshed every step.
    # One step per block: every step a refresh.
    (
      'dual',
      dataclasses.replace(
        tiny_sampler.CACHE_BASE, steps=2, cfg_scale=1.5, temperature=0.7, top_p=0.9
      ),
    ),
  ],
  ids=['prefix_refresh_every_step', 'dual_one_step_per_block_cfg_sampled'],
)
def test_prefix_and_dual_are_exact_where_the_approximation_is(mode, sampling):
  """Against `none` in the fast path's own (fused) layout: sampled with top-p, the unfused
  layout's float32 rounding (1e-6 apart) moves a token across the nucleus' edge in one row."""
  model_config, params = _models('bidirectional')
  got, want = tiny_sampler.cached_and_uncached(
    model_config, params, dataclasses.replace(sampling, cache=mode), plain=False
  )
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('mode', ['prefix', 'dual'])
def test_prefix_and_dual_reuse_kv_exactly_for_a_causal_model(mode):
  """Several cached steps per block; exact here, as no kept K/V depends on later positions."""
  got, want = tiny_sampler.cached_and_uncached(
    *_models('causal'), dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode, cfg_scale=0.5)
  )
  np.testing.assert_array_equal(got, want)


def test_dual_is_an_approximation_for_a_bidirectional_model():
  """The kept K/V are used between refreshes: the tokens differ from none's, and a mid-block
  refresh changes them again."""
  got, want = tiny_sampler.cached_and_uncached(
    *_models('bidirectional'), dataclasses.replace(tiny_sampler.CACHE_BASE, cache='dual')
  )
  assert (got != want).any() and not (got == tiny_sampler.MASK).any()
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache='dual', cache_refresh=2)
  refreshed = tiny_sampler.generate(*_models('bidirectional'), sampling)
  assert (refreshed != got).any()


@pytest.mark.parametrize('mode,backend', [('block', 'xla'), ('dual', 'xla'), ('dual', 'pallas')])
def test_cached_sampler_sharded_over_a_mesh_equals_one_device(mode, backend):
  """pallas: the in-place kernel per shard (the stacked cache split over batch and heads)."""
  assert jax.device_count() == 8
  mesh = mesh_lib.make_mesh(tiny_test_config(**{'mesh.data': 2, 'mesh.fsdp': 4}))
  options = (('model.attention_backend', backend),) if backend != 'xla' else ()
  model_config, params = _models('causal' if mode == 'block' else 'bidirectional', options=options)
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode, cfg_scale=0.5)
  np.testing.assert_array_equal(
    tiny_sampler.generate(model_config, params, sampling, mesh=mesh),
    tiny_sampler.generate(model_config, params, sampling),
  )


def test_exact_cache_refused_where_inexact():
  with pytest.raises(ValueError, match="cache='block' is exact only for causal"):
    tiny_sampler.generate(
      *_models('bidirectional'), dataclasses.replace(tiny_sampler.CACHE_BASE, cache='block')
    )
  with pytest.raises(ValueError, match='multiple of model.block_size'):
    tiny_sampler.generate(
      *_models('block_causal'),
      dataclasses.replace(tiny_sampler.CACHE_BASE, cache='block', block_length=2),
    )


@pytest.mark.parametrize(
  'kind,mode,changes',
  [
    ('causal', 'prefix', {}),
    ('causal', 'dual', dict(cfg_scale=0.5)),
    ('causal', 'block', dict(threshold=0.3)),
    ('block_causal', 'block', {}),
  ],
)
def test_shifted_model_caches_are_token_identical_to_none(kind, mode, changes):
  """A shifted (Dream-style) model's cached slices start one position early, at the predictor
  of the block's first token: greedy, several cached steps per block, the tokens are none's
  wherever the cache is exact. A slice from the block start would read that token from itself."""
  model_config, params = _models(kind, options=DREAM)
  got, want = tiny_sampler.cached_and_uncached(
    model_config,
    params,
    dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode, **changes),
    tiny_sampler.PROMPTS,
  )
  np.testing.assert_array_equal(got, want)
  assert not (got == tiny_sampler.MASK).any()


def test_shifted_slice_from_one_position_early_equals_the_whole_canvas_forward():
  """Dream (bidirectional, shifted): a slice run from the position before the block, against K/V
  of the same canvas, gives the whole forward's (shifted) logits for the block; its first row,
  with no predecessor in the slice, is not the canvas's and is the row the sampler drops."""
  model_config, params = _models('bidirectional', options=DREAM)
  tokens, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16)
  start = width + 8

  @jax.jit
  def run(params, tokens):
    module = model_lib.merge(model_config, params)
    full = module(tokens, segment_ids_BL=segments, positions_BL=positions)
    _, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
    dual, _ = tiny_sampler.slice_logits(module, tokens, segments, positions, kv, start - 1, 9)
    prefix, _ = tiny_sampler.slice_logits(module, tokens, segments, positions, kv, width - 1, 17)
    return full, dual, prefix

  full, dual, prefix = run(params, tokens)
  np.testing.assert_allclose(dual[:, 1:], full[:, start : start + 8], atol=1e-4)
  np.testing.assert_allclose(prefix[:, 1:], full[:, width:], atol=1e-4)
  assert np.abs(dual[:, 0] - full[:, start - 1]).max() > 1e-2


@pytest.mark.parametrize(
  'kind,mode,options',
  [
    ('causal', 'block', ()),
    ('bidirectional', 'dual', ()),
    ('bidirectional', 'prefix', ()),
    ('block_causal', 'block', DREAM),  # shifted: every slice starts one position early
  ],
)
def test_slice_kernel_decodes_the_xla_backends_tokens(kind, mode, options):
  """model.attention_backend=pallas: every cached step's slice runs the in-place slice kernel
  (flash_attention_slice_cached, interpret mode here; the 24-position canvas is no multiple of
  its 16-key tile, so a shifted last tile too), and the tokens are the xla backend's (its
  copying path), token for token (whose block cache is none's:
  test_block_cache_is_token_identical_to_none)."""
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode, cfg_scale=0.5)
  pallas_config, params = _models(kind, options=(('model.attention_backend', 'pallas'), *options))
  xla_config, xla_params = _models(kind, options=options)
  prompt_BP, lengths_B = prompt_rows.pad_prompts(tiny_sampler.PROMPTS, tiny_sampler.PAD)
  fn = sampler_programs.make_generate_fn(
    pallas_config, sampling, mask_id=tiny_sampler.MASK, eos_id=2, pad_id=tiny_sampler.PAD
  )
  jaxpr = str(fn.trace(params, prompt_BP, lengths_B, jax.random.key(0)).jaxpr)
  assert 'flash_attention_slice_cached' in jaxpr
  assert 'flash_attention_slice ' not in jaxpr  # no copying slice kernel left
  got = tiny_sampler.generate(pallas_config, params, sampling)
  np.testing.assert_array_equal(got, tiny_sampler.generate(xla_config, xla_params, sampling))


@pytest.mark.parametrize('copying', [False, True])
def test_cached_slice_forward_copies_no_cache_on_gpu(copying, monkeypatch):
  """A pallas model's dual slice forward, lowered for CUDA on this host (traced as on a GPU):
  the Triton call reads the whole stacked cache [layers, B, S, K, H] and nothing cuts or writes a
  [B, S, K, H] copy of a layer's; copying=True (attention.gathered_slice_attention, the path
  before the in-place kernel) shows the check sees those copies."""
  model_config, params = _models('bidirectional', options=(('model.attention_backend', 'pallas'),))
  tokens, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16)
  shape = (model_config.num_layers, len(tiny_sampler.PROMPTS), tokens.shape[1], 2, 16)
  kv = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2

  def run(params, kv):
    module = model_lib.merge(model_config, params)
    return tiny_sampler.slice_logits(module, tokens, segments, positions, kv, width + 8, 8)

  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  if copying:
    monkeypatch.setattr(attention, 'cached_slice_attention', attention.gathered_slice_attention)
  text = jax.jit(run).trace(params, kv).lower(lowering_platforms=('cuda',)).as_text()
  cache = 'tensor<{}xf32>'.format('x'.join(map(str, shape)))
  layer = 'x{}xf32>'.format('x'.join(map(str, shape[1:])))  # [B, S, K, H], [1, B, S, K, H]
  calls = [line.rsplit(' -> ', 1)[0] for line in text.splitlines() if 'xla.gpu.triton' in line]
  assert len(calls) == 1  # one kernel, in the layer scan's body
  assert (cache in calls[0]) != copying  # copying: a layer's copy, padded to 32 keys
  copies = [
    line.rsplit(' -> ', 1)[1]
    for line in text.splitlines()
    if ('dynamic_slice' in line or 'dynamic_update_slice' in line) and ' -> ' in line
  ]
  assert any(layer in c for c in copies) == copying, copies


@pytest.mark.gpu
@pytest.mark.parametrize('kind,mode', [('causal', 'block'), ('bidirectional', 'dual')])
def test_gpu_in_place_slices_equal_the_copying_slices(kind, mode, monkeypatch):
  """On the GPU (Triton): the in-place kernel's slice logits are the copying path's (a layer's
  cache gathered, the fresh K/V written in, then the slice kernel), and the pallas sampler
  decodes every token of its cache mode."""
  model_config, params = _models(kind, options=(('model.attention_backend', 'pallas'),))
  tokens, segments, positions, width = tiny_sampler.canvas(tiny_sampler.PROMPTS, 16)

  def run(params):
    module = model_lib.merge(model_config, params)
    _, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
    slices = ((width + 8, 8), (width - 1, 17))  # dual's block; a shifted prefix's
    return [
      tiny_sampler.slice_logits(module, tokens, segments, positions, kv, *s)[0] for s in slices
    ]

  got = jax.jit(lambda p: run(p))(params)  # a new function each: no trace of the other path
  monkeypatch.setattr(attention, 'cached_slice_attention', attention.gathered_slice_attention)
  want = jax.jit(lambda p: run(p))(params)
  # Triton runs f32 dots in TF32 and the in-place kernel sums the fresh keys as tiles of their
  # own: 0.35% apart at most on the H200, where a misplaced key moves logits by O(1).
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-2 * float(np.abs(w).max()))
  monkeypatch.undo()
  out = tiny_sampler.generate(
    model_config, params, dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode, cfg_scale=0.5)
  )
  assert not (out == tiny_sampler.MASK).any()


@pytest.mark.parametrize('mode', ['none', 'dual'])
def test_fused_projections_decode_the_unfused_tokens(mode):
  """generate's inference layout (q / k / v and gate / up one matmul each, over weights fused
  once per generate) commits the tokens of the trained layout's three and two matmuls, cached
  slices and q / k / v biases included, and its program has fewer matmuls."""
  model_config, params = _models('bidirectional', options=(('model.qkv_bias', True),))
  params = jax.tree.map(lambda x: x + 0.01, params)  # non-zero biases
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache=mode)
  args = (
    params,
    *prompt_rows.pad_prompts(tiny_sampler.PROMPTS, tiny_sampler.PAD),
    jax.random.key(0),
  )
  tokens, matmuls = [], []
  for fuse in (True, False):
    fn = sampler_programs.make_generate_fn(
      model_config,
      sampling,
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
      vocab_size=tiny_sampler.VOCAB,
      fuse_projections=fuse,
    )
    matmuls.append(fn.lower(*args).as_text().count('dot_general'))
    tokens.append(np.asarray(fn(*args)))
  np.testing.assert_array_equal(tokens[0], tokens[1])
  assert not (tokens[0] == tiny_sampler.MASK).any()
  assert matmuls[0] < matmuls[1]


def test_a_mesh_splitting_the_heads_decodes_the_same_tokens_unfused():
  """Over mesh.tensor the heads are split, so the sampler keeps q / k / v apart there
  (model.splits_projections); its tokens are the fused one-device decode's."""
  tensor = mesh_lib.make_mesh(tiny_test_config(**{'mesh.data': 4, 'mesh.tensor': 2}))
  batch_only = mesh_lib.make_mesh(tiny_test_config(**{'mesh.data': 2, 'mesh.fsdp': 4}))
  assert model_lib.splits_projections(tensor) and not model_lib.splits_projections(batch_only)
  model_config, params = _models('bidirectional')
  sampling = dataclasses.replace(tiny_sampler.CACHE_BASE, cache='dual')
  np.testing.assert_array_equal(
    tiny_sampler.generate(model_config, params, sampling, mesh=tensor),
    tiny_sampler.generate(model_config, params, sampling),
  )
