"""LLaDA2.1's token-to-token editing (sampler.edit_threshold / edit_steps, diffusion/decoding.py)
against the rule written out: one step's edit set on random logits, then whole decodes of a tiny
LLaDA2 model imported from a directory laid out as the family ships it, with the block K/V cache
and the threshold, against a per-row loop that runs the full forward every step (SGLang's
JointThreshold order: commit the masks, edit the committed tokens; after the masks run out, edit
until a step changes nothing or the budget is spent)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from dlmjax.diffusion import (
  block_loop,
  decoding,
  prompt_rows,
  sampler_programs,
  sampler_settings,
  sampling_config,
)
from tests.checkpoint import family_dirs

MASK, EOS, VOCAB, BLOCK = 250, 2, 256, 4  # family_dirs.LLADA2_CONFIG
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [20], [30, 31, 32, 33, 34, 35, 36]]
WIDTH = 32  # the reference's canvas
# Blocks of the model's 4 positions, 4 steps each, LLaDA2's threshold rule; edits above 0.2.
PLAIN = sampling_config.SamplingConfig(
  gen_length=8, steps=8, block_length=4, threshold=0.5, cache='block'
)
EDITING = dataclasses.replace(PLAIN, edit_threshold=0.2, edit_steps=3)


def _softmax(logits):
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def test_one_step_edits_exactly_the_confident_disagreeing_committed_tokens():
  """commit_step with edit_threshold: the masks the threshold commits (no schedule here), plus
  every committed decodable token x_i with argmax v_i != x_i and p(v_i) > edit_threshold."""
  rng = np.random.default_rng(0)
  rows, k, vocab = 16, 8, 12
  logits = rng.normal(0, 1, (rows, k, vocab)).astype(np.float32)
  logits[..., 4] += rng.uniform(0, 6, (rows, k)).astype(np.float32)
  logits[..., 3] = -np.inf  # MASK (id 3 here) is never predicted
  x_BK = rng.choice([3, 4, 5], (rows, k)).astype(np.int32)
  decodable = rng.uniform(size=(rows, k)) < 0.8
  settings = sampling_config.SamplingConfig(threshold=0.6, edit_threshold=0.4)
  got = decoding.commit_step(
    logits,
    x_BK,
    np.zeros(rows, np.int32),
    block_loop.step_keys(jax.random.key(0), 0, 0),
    settings,
    mask_id=3,
    decodable_BK=decodable,
  )
  p = _softmax(logits.astype(np.float64))
  v, top = p.argmax(-1), p.max(-1)
  masked = (x_BK == 3) & decodable
  want = np.where(masked & (top >= 0.6), v, x_BK)
  edited = ~masked & decodable & (x_BK != 3) & (v != x_BK) & (top > 0.4)
  want = np.where(edited, v, want)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert edited.sum() > 5 and (edited != (np.asarray(got) != x_BK) & ~masked).sum() == 0


@pytest.fixture(scope='module')
def llada2(tmp_path_factory):
  hf_dir, _, _ = family_dirs.llada2_dir(tmp_path_factory.mktemp('llada2'))
  config, params = hf_io.load_hf(hf_dir)
  return model_lib.ModelConfig.from_config(config), params


def _decode(llada2, sampling):
  model_config, params = llada2
  prompt_BP, lengths_B = prompt_rows.pad_prompts(PROMPTS, EOS)
  fn = sampler_programs.make_generate_fn(
    model_config, sampling, mask_id=MASK, eos_id=EOS, pad_id=EOS, vocab_size=VOCAB
  )
  out = fn(params, prompt_BP, lengths_B, jax.random.key(0))
  return np.asarray(out)[:, prompt_BP.shape[1] :]


def _reference(forward, prompt, s):
  """One row, greedy: blocks from its prompt's last whole block (block-causal decoding). Per
  step a full forward of the row alone; while the block holds masks, the schedule's most
  confident and every one with p >= threshold commit; every step, committed completion tokens
  of the block with argmax v != x and p(v) > edit_threshold become v. A step that finds no mask
  counts one edit step; the block ends when such a step changes nothing or after edit_steps."""
  n, spb = len(prompt), s.steps_per_block
  x = np.full(WIDTH, MASK)
  x[:n] = prompt
  for lo in range(n // BLOCK * BLOCK, n + s.gen_length, s.block_length):
    index = np.arange(lo, lo + s.block_length)
    completion = index >= n
    count = ((x[lo : lo + s.block_length] == MASK) & completion).sum()
    transfer = count // spb + (np.arange(spb) < count % spb)
    step = post = 0
    while True:
      block = x[lo : lo + s.block_length]
      masked = (block == MASK) & completion
      if not masked.any():
        if not s.edit_threshold or post == s.edit_steps:
          break
        post += 1
      logits = forward(x)[lo : lo + s.block_length]
      logits[:, MASK], logits[:, VOCAB:] = -np.inf, -np.inf
      p = _softmax(logits)
      v, top = p.argmax(-1), p.max(-1)
      conf = np.where(masked, top, -np.inf)
      rank = np.argsort(np.argsort(-conf, kind='stable'), kind='stable')
      commit = masked & ((rank < transfer[min(step, spb - 1)]) | (conf >= s.threshold))
      edit = np.zeros_like(masked)
      if s.edit_threshold:
        edit = completion & ~masked & (v != block) & (top > s.edit_threshold)
      if not masked.any() and not edit.any():
        break
      x[lo : lo + s.block_length] = np.where(commit | edit, v, block)
      step += 1
  return x[n : n + s.gen_length]


@pytest.mark.slow  # two sampler compiles of the MoE model, ~15 s
def test_block_cache_decoding_of_the_family_with_and_without_editing_is_the_reference(llada2):
  model_config, params = llada2
  fn = jax.jit(lambda p, t: model_lib.merge(model_config, p)(t))
  forward = functools.lru_cache(maxsize=None)(
    lambda t: np.asarray(fn(params, np.asarray(t, np.int32)[None])[0], np.float64)
  )

  def reference(s):
    return np.stack([_reference(lambda x: forward(tuple(x)).copy(), p, s) for p in PROMPTS])

  plain, edited = _decode(llada2, PLAIN), _decode(llada2, EDITING)
  np.testing.assert_array_equal(plain, reference(PLAIN))
  np.testing.assert_array_equal(edited, reference(EDITING))
  assert (plain != edited).any()  # the edits changed committed tokens
  assert not (edited == MASK).any()


def test_edit_settings_are_checked_and_the_modes_are_settings():
  for mode in sampler_settings.LLADA21_MODES.values():
    sampling_config.SamplingConfig(**mode).validate()
  with pytest.raises(ValueError, match=r'edit_threshold=1.0 must lie in \[0, 1\)'):
    sampling_config.SamplingConfig(edit_threshold=1.0).validate()
  with pytest.raises(ValueError, match='edit_steps=-1 must be an integer >= 0'):
    sampling_config.SamplingConfig(edit_steps=-1).validate()
