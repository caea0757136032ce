"""The sampler against a plain numpy statement of LLaDA's generate loop (decode_references),
driving the same model."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
from scipy import stats

from dlmjax import model as model_lib
from dlmjax.diffusion import decoding, prompt_rows, sampler, sampling_config, schedules
from dlmjax.parallel import mesh as mesh_lib
from tests.conftest import tiny_test_config
from tests.diffusion import tiny_sampler
from tests.diffusion.decode_references import llada_reference


@pytest.fixture(scope='module')
def tiny():
  model_config, params = tiny_sampler.model()
  forward = jax.jit(
    lambda p, tokens, seg, pos: model_lib.merge(model_config, p)(
      tokens, segment_ids_BL=seg, positions_BL=pos
    )
  )
  return model_config, params, lambda *a: np.asarray(forward(params, *a), np.float64)


@pytest.mark.parametrize(
  'remasking,cfg_scale',
  [('low_confidence', 0.0), ('random', 0.0), ('low_confidence', 1.5), ('random', 0.5)],
)
def test_matches_llada_token_for_token(tiny, remasking, cfg_scale):
  model_config, params, logits_fn = tiny
  s = sampling_config.SamplingConfig(
    gen_length=16, steps=6, block_length=8, remasking=remasking, cfg_scale=cfg_scale
  )
  out = tiny_sampler.generate(model_config, params, s)
  expected, _ = llada_reference(logits_fn, tiny_sampler.PROMPTS, s)
  assert out.shape == (8, 8 + 16) and not (out == tiny_sampler.MASK).any()
  np.testing.assert_array_equal(out, expected)


def test_shifted_model_matches_the_reference_on_shifted_logits(tiny):
  """model.shift_logits (Dream): the sampler's block slice of the shifted model decodes as the
  reference loop does on the unshifted model's logits moved right by one, Dream's generate
  (cat([logits[:, :1], logits[:, :-1]], 1)); the same weights unshifted decode differently."""
  model_config, params, logits_fn = tiny
  s = sampling_config.SamplingConfig(gen_length=16, steps=6, block_length=8, schedule='linear')
  dream_logits = _shifted(logits_fn)

  shifted = dataclasses.replace(model_config, shift_logits=True)
  expected, _ = llada_reference(dream_logits, tiny_sampler.PROMPTS, s)
  out = tiny_sampler.generate(shifted, params, s)
  np.testing.assert_array_equal(out, expected)
  assert (out != tiny_sampler.generate(model_config, params, s)).any()


def _shifted(logits_fn):
  """Dream's logits: cat([logits[:, :1], logits[:, :-1]], 1) of the unshifted model's."""

  def shifted(*a):
    logits = logits_fn(*a)
    return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)

  return shifted


def dream_reference(logits_fn, prompts, steps, gen_length, alg, eps=1e-3):
  """Dream's diffusion_generate at temperature 0 (alg_temp 0), written out: every step, each
  masked position's prediction and its confidence by `alg`; int(m * (1 - s / t)) of the batch's
  mean m masked commit (the last step: all of them), t on torch.linspace(1, eps, steps + 1)."""
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, tiny_sampler.PAD)
  batch, width = prompt_BP.shape
  x = np.concatenate([prompt_BP, np.full((batch, gen_length), tiny_sampler.MASK)], 1)
  index = np.arange(width + gen_length)[None]
  offset = (width - lengths_B)[:, None]
  seg, pos = (index >= offset).astype(np.int32), np.maximum(index - offset, 0)
  timesteps = torch.linspace(1, eps, steps + 1)
  for i in range(steps):
    mask_index = x == tiny_sampler.MASK
    logits = logits_fn(x, seg, pos)
    logits[..., tiny_sampler.VOCAB :] = -np.inf
    logits[..., tiny_sampler.MASK] = -np.inf  # dlmjax never predicts MASK (Dream would, untrained).
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x0 = probs.argmax(-1)
    if alg == 'maskgit_plus':
      confidence = probs.max(-1)
    else:  # entropy
      confidence = (probs * np.log(probs + 1e-10)).sum(-1)
    t, s = timesteps[i], timesteps[i + 1]
    num_mask_token = torch.tensor(mask_index.sum()) / batch
    n = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
    full_confidence = np.where(mask_index, confidence, -np.inf)
    for j in range(batch):
      select = np.argsort(-full_confidence[j], kind='stable')[:n]
      x[j, select] = x0[j, select]
  return x


@pytest.mark.parametrize('alg', ['maskgit_plus', 'entropy'])
def test_dream_family_decodes_with_dreams_schedule(tiny, alg):
  """A shifted (Dream-family) model decodes with Dream's schedule by default (schedule auto),
  token for token as Dream's own loop; LLaDA's even split decodes otherwise."""
  model_config, params, logits_fn = tiny
  shifted = dataclasses.replace(model_config, shift_logits=True)
  s = sampling_config.SamplingConfig(gen_length=16, steps=8, block_length=16, remasking=alg)
  out = tiny_sampler.generate(shifted, params, s)
  np.testing.assert_array_equal(
    out, dream_reference(_shifted(logits_fn), tiny_sampler.PROMPTS, 8, 16, alg)
  )
  linear = tiny_sampler.generate(shifted, params, dataclasses.replace(s, schedule='linear'))
  assert (out != linear).sum() > 8
  explicit = tiny_sampler.generate(model_config, params, dataclasses.replace(s, schedule='dream'))
  np.testing.assert_array_equal(
    explicit, dream_reference(logits_fn, tiny_sampler.PROMPTS, 8, 16, alg)
  )


def test_mask_in_softmax_scores_as_llada(tiny):
  """mask_in_softmax: LLaDA's low_confidence, the softmax over the whole vocabulary MASK
  included, reorders commits against the default (MASK out of the softmax); MASK is still
  never predicted."""
  model_config, params, logits_fn = tiny
  s = dataclasses.replace(tiny_sampler.BASE, mask_in_softmax=True)
  out = tiny_sampler.generate(model_config, params, s)
  np.testing.assert_array_equal(out, llada_reference(logits_fn, tiny_sampler.PROMPTS, s)[0])
  assert (out != tiny_sampler.generate(model_config, params, tiny_sampler.BASE)).any()
  assert not (out == tiny_sampler.MASK).any()


def test_threshold_decoding_matches_reference_and_finishes_early(tiny):
  model_config, params, logits_fn = tiny
  s = sampling_config.SamplingConfig(gen_length=16, steps=16, block_length=8, threshold=0.3)
  expected, forwards = llada_reference(logits_fn, tiny_sampler.PROMPTS[:2], s)
  assert forwards < s.steps  # the threshold committed several tokens in some step.
  np.testing.assert_array_equal(
    tiny_sampler.generate(model_config, params, s, prompts=tiny_sampler.PROMPTS[:2]), expected
  )


def test_stop_at_eos_keeps_the_text(tiny):
  model_config, params, _ = tiny
  plain = tiny_sampler.generate(model_config, params, tiny_sampler.BASE)
  first_block = plain[:, 8:16]
  # An EOS id every row committed in its first block, so the second block is skipped.
  eos = next(t for t in np.unique(first_block) if all((row == t).any() for row in first_block))
  fast = tiny_sampler.generate_fn(
    model_config, dataclasses.replace(tiny_sampler.BASE, stop_at_eos=True), eos_id=int(eos)
  )
  out = np.asarray(
    fast(
      params, *prompt_rows.pad_prompts(tiny_sampler.PROMPTS, tiny_sampler.PAD), jax.random.key(0)
    )
  )
  assert (out[:, 16:] == eos).all()
  assert prompt_rows.completions(out, 8, eos) == prompt_rows.completions(plain, 8, eos)


def test_sharded_over_a_mesh_equals_one_device(tiny):
  model_config, params, _ = tiny
  mesh = mesh_lib.make_mesh(tiny_test_config(**{'mesh.data': 2, 'mesh.fsdp': 4}))
  np.testing.assert_array_equal(
    tiny_sampler.generate(model_config, params, tiny_sampler.BASE, mesh=mesh),
    tiny_sampler.generate(model_config, params, tiny_sampler.BASE),
  )


def test_truncated_canvas_is_exact_for_block_causal_models():
  model_config, params = tiny_sampler.model(
    **{'model.attention_mask': 'block_causal', 'model.block_size': 8}
  )
  s = sampling_config.SamplingConfig(
    gen_length=16, steps=8, block_length=8, temperature=0.8, remasking='random'
  )
  plain = tiny_sampler.generate(model_config, params, s, key=3)
  np.testing.assert_array_equal(
    tiny_sampler.generate(model_config, params, dataclasses.replace(s, cache='truncate'), key=3),
    plain,
  )
  # A key fixes the draw; another key gives another one.
  np.testing.assert_array_equal(tiny_sampler.generate(model_config, params, s, key=3), plain)
  assert (tiny_sampler.generate(model_config, params, s, key=4) != plain).any()


def test_truncation_refused_where_inexact(tiny):
  model_config, params, _ = tiny
  s = sampling_config.SamplingConfig(gen_length=16, steps=8, block_length=8, cache='truncate')
  with pytest.raises(ValueError, match="cache='none'"):
    tiny_sampler.generate(model_config, params, s)
  block_causal, bc_params = tiny_sampler.model(
    **{'model.attention_mask': 'block_causal', 'model.block_size': 8}
  )
  with pytest.raises(ValueError, match='multiple of model.block_size'):
    tiny_sampler.generate(block_causal, bc_params, dataclasses.replace(s, block_length=4))


def test_num_transfer_tokens():
  n = np.random.default_rng(0).integers(0, 40, 16)
  got = np.asarray(schedules.num_transfer_tokens(n, 7))
  for row, count in zip(got, n):
    expected = [count // 7 + (s < count % 7) for s in range(7)]
    np.testing.assert_array_equal(row, expected)
    assert row.sum() == count


def test_gumbel_noise_follows_the_gumbel_law_into_the_tails():
  noise = jax.jit(decoding.gumbel_noise, static_argnums=1)
  g = np.asarray(noise(jax.random.key(0), (400_000,)), np.float64)
  assert stats.kstest(g, 'gumbel_r').pvalue > 1e-3
  # P(g > 9) = 1 - exp(-e^-9) = 1.23e-4: ~49 of 400k; float32 uniforms cap the noise near 16.
  assert 25 < (g > 9).sum() < 80 and g.max() > 10 and g.min() > -4
  tail = np.asarray(noise(jax.random.key(1), (4_000_000,)))
  assert tail.max() > 13  # P(max of 4e6 < 13) = exp(-4e6 * 2.3e-6) = 1e-4.


def test_sample_tokens_draws_from_top_p_then_temperature():
  logits = np.random.default_rng(1).normal(0, 2, 10).astype(np.float32)
  temperature, top_p = 0.7, 0.8
  order = np.argsort(-logits)
  probs = np.exp(logits[order] - logits.max())
  probs /= probs.sum()
  kept = order[(np.cumsum(probs) - probs) < top_p]
  expected = np.zeros(10)
  expected[kept] = np.exp((logits[kept] - logits.max()) / temperature)
  expected /= expected.sum()
  draw = jax.jit(decoding.sample_tokens, static_argnums=(2, 3))
  draws = np.asarray(draw(np.tile(logits, (50_000, 1)), jax.random.key(2), temperature, top_p))
  freq = np.bincount(draws, minlength=10) / len(draws)
  np.testing.assert_allclose(freq, expected, atol=0.01)
  assert set(np.flatnonzero(freq)) == set(kept)
  np.testing.assert_array_equal(
    decoding.sample_tokens(np.tile(logits, (3, 1)), jax.random.key(2), 0.0), [order[0]] * 3
  )


def test_pad_prompts_and_completions():
  prompt_BP, lengths = prompt_rows.pad_prompts([[5, 6], [], [7]], tiny_sampler.PAD, width=3)
  np.testing.assert_array_equal(prompt_BP, [[0, 5, 6], [0, 0, 0], [0, 0, 7]])
  np.testing.assert_array_equal(lengths, [2, 0, 1])
  with pytest.raises(ValueError, match='width'):
    prompt_rows.pad_prompts([[1, 2, 3]], tiny_sampler.PAD, width=2)
  out = np.array([[9, 4, 5, tiny_sampler.EOS, 6], [9, 4, 4, 4, 4]])
  assert prompt_rows.completions(out, 1, tiny_sampler.EOS) == [[4, 5], [4, 4, 4, 4]]


@pytest.mark.parametrize(
  'kwargs,message',
  [
    (dict(gen_length=30, block_length=8), 'multiple of block_length'),
    (dict(gen_length=32, block_length=8, steps=6), 'multiple of the 4 blocks'),
    (dict(remasking='sideways'), 'not a decoding order'),
    (dict(remasking='topk_margin'), "closest to 'margin'"),
    (dict(alg_temp=-1.0), 'alg_temp'),
    (dict(factor=-1.0), 'factor'),
    (dict(threshold=0.9, factor=1.0), 'set one of them to 0'),
    (dict(remasking='entropy', factor=1.0), 'negative entropy'),
    (dict(top_p=0.0), 'top_p'),
    (dict(temperature=-1.0), 'temperature'),
    (dict(cache='kv'), 'unknown cache'),
    (dict(cache='dual', cache_refresh=3), 'cache_refresh=3 must be 0'),
    (dict(cache='block', cache_refresh=2), "needs cache='prefix' or 'dual'"),
    (dict(threshold=2.0), 'threshold'),
  ],
)
def test_bad_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sampling_config.SamplingConfig(**kwargs).validate()


def test_prompt_longer_than_the_canvas_is_refused(tiny):
  model_config, params, _ = tiny
  module = model_lib.merge(model_config, params)
  prompt_BP, lengths = prompt_rows.pad_prompts([list(range(5, 25))], tiny_sampler.PAD)
  with pytest.raises(ValueError, match='exceed the model context'):
    sampler.generate(
      module,
      prompt_BP,
      lengths,
      tiny_sampler.BASE,
      jax.random.key(0),
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
    )
  with pytest.raises(ValueError, match='pad_id and mask_id'):
    sampler.generate(
      module,
      prompt_BP[:, :4],
      lengths * 0 + 4,
      tiny_sampler.BASE,
      jax.random.key(0),
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.MASK,
    )
