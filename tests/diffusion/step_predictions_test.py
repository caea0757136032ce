"""The sampler's per-step predictions x_0|l (decode_blocks with_predictions, wd1++'s targets):
each step's prediction holds the committed tokens, commits its own predictions, and fills the
masked rest with the model's argmax of the state the commit steps reconstruct."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler
from tests.diffusion import tiny_sampler


def _decode(model_config, params, sampling, with_predictions=True):
  prompt_BP, lengths_B = prompt_rows.pad_prompts(tiny_sampler.PROMPTS, tiny_sampler.PAD)
  fn = jax.jit(
    lambda p, x, n, k: sampler.decode_blocks(
      model_lib.merge(model_config, p),
      x,
      n,
      sampling,
      k,
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
      with_predictions=with_predictions,
    )
  )
  out = fn(params, prompt_BP, lengths_B, jax.random.key(1))
  return prompt_BP, lengths_B, [np.asarray(a) for a in out]


@pytest.mark.parametrize('temperature', [0.0, 0.8])
def test_step_predictions_match_commits_and_the_reconstructed_states(temperature):
  model_config, params = tiny_sampler.model()
  sampling = dataclasses.replace(tiny_sampler.BASE, temperature=temperature)
  prompt_BP, lengths_B, (tokens, _, steps, preds) = _decode(model_config, params, sampling)
  width, gen, total = prompt_BP.shape[1], tiny_sampler.BASE.gen_length, tiny_sampler.BASE.steps
  completion = tokens[:, width:]
  assert preds.shape == (len(tiny_sampler.PROMPTS), total, gen) and (steps >= 0).all()
  # The normal path is unchanged: the same completions without predictions.
  plain = _decode(model_config, params, sampling, with_predictions=False)[2][0]
  np.testing.assert_array_equal(plain, tokens)
  np.testing.assert_array_equal(preds[:, -1], completion)  # x_0|L = the final completion
  for step in range(total):
    done = steps <= step  # committed before step l, or by it: the prediction is the token
    np.testing.assert_array_equal(np.where(done, preds[:, step], 0), np.where(done, completion, 0))
  if temperature:
    return
  # Greedy: x_0|l's masked tokens are the argmax of one forward of x_l (masked iff step >= l).
  positions = np.arange(width + gen)[None]
  real = positions >= (width - lengths_B)[:, None]
  module = model_lib.merge(model_config, params)
  forward = jax.jit(lambda x, s, p: module(x, segment_ids_BL=s, positions_BL=p))
  segments = real.astype(np.int32)
  pos = np.maximum(positions - (width - lengths_B)[:, None], 0)
  for step in range(total):
    x_l = np.concatenate(
      [prompt_BP, np.where(steps >= step, tiny_sampler.MASK, completion)], axis=1
    )
    logits = np.array(forward(x_l, segments, pos), np.float32)[:, width:]
    logits[..., tiny_sampler.MASK] = -np.inf
    masked = steps >= step
    np.testing.assert_array_equal(
      np.where(masked, logits.argmax(-1), 0), np.where(masked, preds[:, step], 0)
    )


def test_step_predictions_refuse_a_cache():
  model_config, params = tiny_sampler.model()
  module = model_lib.merge(model_config, params)
  prompt_BP, lengths_B = prompt_rows.pad_prompts(tiny_sampler.PROMPTS, tiny_sampler.PAD)
  with pytest.raises(ValueError, match='set sampler.cache=none'):
    sampler.decode_blocks(
      module,
      jnp.asarray(prompt_BP),
      lengths_B,
      dataclasses.replace(tiny_sampler.BASE, cache='prefix'),
      jax.random.key(0),
      mask_id=tiny_sampler.MASK,
      eos_id=tiny_sampler.EOS,
      pad_id=tiny_sampler.PAD,
      with_predictions=True,
    )
