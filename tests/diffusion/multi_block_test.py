"""d3LLM's multi-block decoding against its loop written out in numpy (hao-ai-lab/d3LLM
`generate_multi_block`: block states as dicts, one prompt at a time), driving the same model."""

import dataclasses

import jax
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from tests.diffusion import tiny_sampler

MASK, PAD, VOCAB = tiny_sampler.MASK, tiny_sampler.PAD, tiny_sampler.VOCAB
BASE = sampling_config.SamplingConfig(
  gen_length=16,
  steps=16,
  block_length=4,
  temperature=0.0,
  block_add_threshold=0.25,
  entropy_threshold=2.9,  # the tiny model's entropies: 2.3-3.1 nats, 2.9 about its 25th percentile
)


@pytest.fixture(scope='module')
def tiny():
  model_config, params = tiny_sampler.model()
  forward = jax.jit(
    lambda p, tokens, seg, pos: model_lib.merge(model_config, p)(
      tokens, segment_ids_BL=seg, positions_BL=pos
    )
  )
  return model_config, params, lambda *a: np.asarray(forward(params, *a), np.float64)


def d3llm_reference(logits_fn, prompts, s, decoded_token_threshold):
  """generate_multi_block, greedy, without early stop, one row at a time: (x, commit steps)."""
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, PAD)
  batch, width = prompt_BP.shape
  x = np.concatenate([prompt_BP, np.full((batch, s.gen_length), MASK)], 1)
  steps = np.full(x.shape, -1)
  index = np.arange(x.shape[1])[None]
  offset = (width - lengths_B)[:, None]
  seg, pos = (index >= offset).astype(np.int32), np.maximum(index - offset, 0)
  num_blocks, size = s.gen_length // s.block_length, s.block_length
  for j in range(batch):
    states = {0: dict(start=0, end=width, mask_count=0, total=width, complete=True)}
    states[1] = dict(start=width, end=width + size, mask_count=size, total=size, complete=True)
    next_id, nfe = 2, 0

    def progress(b):
      return 1 - states[b]['mask_count'] / states[b]['total']

    while True:
      if (x[j, width:] == MASK).sum() == 0 and next_id > num_blocks:
        break
      for b in sorted(states):  # activation
        if b > 0 and not states[b]['complete'] and progress(b - 1) >= decoded_token_threshold:
          states[b]['complete'] = True
      last = max(states)
      if next_id <= num_blocks and (
        progress(last) >= s.block_add_threshold or states[last]['mask_count'] == 0
      ):
        start = width + (next_id - 1) * size
        states[next_id] = dict(
          start=start,
          end=start + size,
          mask_count=int((x[j, start : start + size] == MASK).sum()),
          total=size,
          complete=progress(next_id - 1) >= decoded_token_threshold,
        )
        next_id += 1
      active = [b for b in sorted(states) if states[b]['complete'] or states[b]['mask_count'] > 0]
      active_end = states[active[-1]]['end']
      logits = logits_fn(x[j : j + 1], seg[j : j + 1], pos[j : j + 1])[0]
      logits[:, VOCAB:] = -np.inf
      logits[:, MASK] = -np.inf  # dlmjax never predicts MASK, nor scores it (mask_in_softmax off)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      entropy = -(p * np.log(p + 1e-12)).sum(-1)
      x0 = logits.argmax(-1)
      candidates = (x[j] == MASK) & (index[0] >= width) & (index[0] < active_end)
      ranked = np.where(candidates, entropy, np.inf)
      order = np.argsort(ranked, kind='stable')
      transfer = np.zeros(x.shape[1], bool)
      transfer[order[0]] = candidates[order[0]]
      transfer |= candidates & (entropy <= s.entropy_threshold)
      first = [b for b in sorted(states) if b > 0 and states[b]['complete']]
      first = [b for b in first if states[b]['mask_count'] > 0]
      if first:
        lo, hi = states[first[0]]['start'], states[first[0]]['end']
        if not transfer[lo:hi].any():
          transfer[lo + np.argmin(np.where(candidates[lo:hi], entropy[lo:hi], np.inf))] = True
      x[j, transfer] = x0[transfer]
      steps[j, transfer] = nfe
      for b in sorted(states):
        if b > 0:
          states[b]['mask_count'] -= int(transfer[states[b]['start'] : states[b]['end']].sum())
      nfe += 1
  return x, steps[:, width:]


def _decode(model_config, params, s, prompts=tiny_sampler.PROMPTS):
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, PAD)
  fn = sampler_programs.make_generate_fn(
    model_config,
    s,
    mask_id=MASK,
    eos_id=tiny_sampler.EOS,
    pad_id=PAD,
    vocab_size=VOCAB,
    with_steps=True,
  )
  tokens, steps = fn(params, prompt_BP, lengths_B, jax.random.key(0))
  return np.asarray(tokens), np.asarray(steps)


@pytest.mark.parametrize(
  'settings',
  [
    dict(),
    dict(entropy_threshold=0.0),
    dict(block_add_threshold=1.0, entropy_threshold=0.0),
  ],
)
def test_matches_d3llm_loop_token_for_token(tiny, settings):
  """Blocks open early and commit several tokens a step (first); the lowest entropy alone, so
  forced progress adds one whenever it lies past the first active block (second); the
  sequential limit (block_add = 1: one block at a time, one token a step)."""
  model_config, params, logits_fn = tiny
  s = dataclasses.replace(BASE, **settings)
  tokens, steps = _decode(model_config, params, s)
  for decoded_token_threshold in (0.95, 0.5):  # d3LLM's; no effect on its uncached loop
    want_x, want_steps = d3llm_reference(
      logits_fn, tiny_sampler.PROMPTS, s, decoded_token_threshold
    )
    np.testing.assert_array_equal(tokens, want_x)
    np.testing.assert_array_equal(steps, want_steps)
  assert (steps >= 0).all() and not (tokens == MASK).any()
  per_row = np.array([len(np.unique(r)) for r in steps])
  if s.block_add_threshold < 1:  # blocks overlap: a later block commits before one is done
    assert any((r[4:8].min() < r[:4].max()) for r in steps)
  per_step = [np.bincount(r).max() for r in steps]  # the most tokens one step committed
  if s.entropy_threshold > 0:  # the lowest entropy, a forced one and those under the threshold
    assert max(per_step) > 2
  else:  # the lowest entropy and at most a forced one
    assert max(per_step) <= 2
  if s.block_add_threshold == 1:
    assert (per_row == s.gen_length).all()


def test_multi_block_settings_are_checked():
  for kwargs, message in (
    (dict(cache='dual'), 'cache=none'),
    (dict(threshold=0.9), 'threshold=0.9 has no effect'),
    (dict(stop_at_eos=True), 'stop_at_eos'),
    (dict(block_add_threshold=1.5), 'block_add_threshold'),
  ):
    with pytest.raises(config_lib.ConfigError, match=message):
      dataclasses.replace(BASE, **kwargs).validate()
