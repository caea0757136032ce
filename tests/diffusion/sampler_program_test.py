"""The sampler's compiled program: logits only for the block a step can commit in, never for
the whole canvas ([B, L, V] float32), in every cache mode and record."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler, sampler_programs
from tests.diffusion.tiny_sampler import BASE, EOS, MASK, PAD, PROMPTS, model

VOCAB_PADDED = 128  # the tiny model's vocabulary of 100, padded to a multiple of 128.


@pytest.fixture(scope='module')
def tiny():
  """The tiny model with an MLP width (96) that no logits axis can be taken for."""
  return model(**{'model.ffn_dim': 96})


def _float32_shapes(model_config, params, sampling, **kwargs):
  """Every float32 array shape in the lowered program of make_generate_fn."""
  fn = sampler_programs.make_generate_fn(
    model_config, sampling, mask_id=MASK, eos_id=EOS, pad_id=PAD, vocab_size=100, **kwargs
  )
  prompt_BP, lengths_B = prompt_rows.pad_prompts(PROMPTS, PAD)
  text = fn.lower(params, prompt_BP, lengths_B, jax.random.key(0)).as_text()
  return prompt_BP.shape[1], {
    tuple(int(d) for d in m.split('x')) for m in re.findall(r'tensor<([\dx]+)xf32>', text)
  }


@pytest.mark.parametrize(
  'changes,kwargs',
  [
    (dict(cache='none', cfg_scale=1.0), dict(with_predictions=True)),
    (dict(cache='dual', top_p=0.9, temperature=0.5, remasking='entropy'), dict(with_steps=True)),
    (dict(cache='prefix'), {}),
  ],
  ids=['none_cfg_predictions', 'dual_sampled', 'prefix'],
)
def test_no_canvas_wide_float32_logits(tiny, changes, kwargs):
  width, shapes = _float32_shapes(*tiny, dataclasses.replace(BASE, **changes), **kwargs)
  length = width + BASE.gen_length
  logits = {s for s in shapes if len(s) >= 3 and s[-1] == VOCAB_PADDED}  # not the head
  assert logits, 'no logits at all: the test reads the program wrongly'
  assert all(s[-2] == BASE.block_length for s in logits), sorted(logits)
  assert not any(length in s[:-1] for s in logits)
  assert np.prod(max(logits, key=np.prod)) <= 2 * len(PROMPTS) * BASE.block_length * VOCAB_PADDED


def test_the_program_returns_the_loops_tokens_and_commit_steps(tiny):
  """make_generate_fn(with_steps=True) is decode_blocks on the inference module, unchanged: the
  same tokens and the same commit step of every generated token (sampled, two blocks)."""
  model_config, params = tiny
  sampling = dataclasses.replace(BASE, cache='dual', temperature=0.7)
  prompt_BP, lengths_B = prompt_rows.pad_prompts(PROMPTS, PAD)
  key = jax.random.key(3)
  program = sampler_programs.make_generate_fn(
    model_config, sampling, mask_id=MASK, eos_id=EOS, pad_id=PAD, vocab_size=100, with_steps=True
  )
  tokens, steps = program(params, prompt_BP, lengths_B, key)

  @jax.jit
  def loop(params):
    module = model_lib.inference_module(model_config, params)
    out = sampler.decode_blocks(
      module,
      prompt_BP,
      lengths_B,
      sampling,
      key,
      mask_id=MASK,
      eos_id=EOS,
      pad_id=PAD,
      vocab_size=100,
    )
    return out[0], out[2]

  want_tokens, want_steps = loop(params)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(steps, want_steps)
  per_block = BASE.steps // (BASE.gen_length // BASE.block_length)
  assert np.asarray(steps).max() >= per_block  # the second block's steps are counted on
