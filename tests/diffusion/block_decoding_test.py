"""Block-by-block decoding of block-causal models with the block K/V cache, against a plain per-row
statement of SDAR's block_diffusion_generate (greedy, no cache: every step a full forward of the
row alone, its blocks counted from its first token); early stop at EOS; the one-line refusals."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler, sampling_config
from tests.diffusion import tiny_sampler

BLOCK_SIZE = 4
# Lengths 3, 5, 1, 4, 7, 8: most are not a multiple of block_size, so most rows' first decoded
# block opens with the end of their prompt.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [20], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46]]
PROMPTS.append(list(range(50, 58)))
REFERENCE_WIDTH = 32  # one compiled reference forward: the model's seq_len.
# SDAR's setting (block 4, one token per step, threshold) and a LLaDA-like one: blocks of 8
# (two model blocks), fixed steps, no threshold.
SDAR = sampling_config.SamplingConfig(gen_length=16, steps=16, block_length=4, threshold=0.3)
FIXED = sampling_config.SamplingConfig(gen_length=16, steps=8, block_length=8)


@functools.lru_cache
def _block_causal():
  return tiny_sampler.model(
    **{'model.attention_mask': 'block_causal', 'model.block_size': BLOCK_SIZE}
  )


@functools.lru_cache
def _decode_fn(sampling):
  """The jitted sampler on the fast path (the inference layout: fused projections, weights cast
  once); eos_id is an argument, so one compile serves every EOS of a setting."""
  model_config, _ = _block_causal()

  @jax.jit
  def fn(params, prompt_BP, lengths_B, key, eos_id):
    module = model_lib.inference_module(model_config, params)
    return sampler.decode_blocks(
      module,
      prompt_BP,
      lengths_B,
      sampling,
      key,
      mask_id=tiny_sampler.MASK,
      eos_id=eos_id,
      pad_id=tiny_sampler.PAD,
      vocab_size=tiny_sampler.VOCAB,
    )

  return fn


def _decode(sampling, eos_id, prompts=PROMPTS):
  """(completions [B, gen_length], blocks decoded) of the batched sampler. Prompts pad to the
  width of PROMPTS and batches of fewer rows repeat theirs to len(PROMPTS): one static shape,
  so the cases of a setting share a compile."""
  _, params = _block_causal()
  rows = [prompts[i % len(prompts)] for i in range(len(PROMPTS))]
  prompt_BP, lengths_B = prompt_rows.pad_prompts(
    rows, tiny_sampler.PAD, width=max(map(len, PROMPTS))
  )
  fn = _decode_fn(sampling)
  out, ran, steps = fn(params, prompt_BP, lengths_B, jax.random.key(0), np.int32(eos_id))
  _decode.steps = np.asarray(steps)[: len(prompts)]  # each token's commit step
  return np.asarray(out)[: len(prompts), prompt_BP.shape[1] :], int(ran)


@functools.lru_cache
def _forward():
  model_config, params = _block_causal()
  fn = jax.jit(lambda p, t: model_lib.merge(model_config, p)(t))
  return lambda tokens: np.asarray(fn(params, np.asarray(tokens, np.int32)[None])[0], np.float64)


def sdar_reference(prompt, s, eos_id=None):
  """One row, SDAR's loop at temperature 0: blocks of block_length from position
  block_size * floor(len / block_size) (the prompt's whole blocks are the prefill, its rest stays
  fixed in the first block); per step the block's masks get x0 = argmax and c = p(x0), and the
  schedule's most confident commit, with every c >= threshold (SDAR's low_confidence_dynamic).
  The schedule spreads the block's masked count over the steps (SDAR spreads block_length, which
  differs only when a prompt's rest shares the block and steps < block_length). MASK is never
  predicted (sampler.generate). Stops after the block where the text ends (an EOS).
  Returns (tokens, the step that committed each: block b's step s is b * steps_per_block + s)."""
  n, block, spb = len(prompt), s.block_length, s.steps_per_block
  first = n // BLOCK_SIZE * BLOCK_SIZE
  x = np.full(REFERENCE_WIDTH, tiny_sampler.MASK)
  x[:n] = prompt
  steps = np.full(REFERENCE_WIDTH, -1)
  for b, lo in enumerate(range(first, n + s.gen_length, block)):
    index = np.arange(lo, lo + block)
    count = ((x[lo : lo + block] == tiny_sampler.MASK) & (index >= n)).sum()
    transfer = count // spb + (np.arange(spb) < count % spb)
    for step in range(spb):
      masked = (x[lo : lo + block] == tiny_sampler.MASK) & (index >= n)
      if not masked.any():
        break
      logits = _forward()(x)[lo : lo + block]  # later blocks are invisible (block-causal).
      logits[:, tiny_sampler.MASK], logits[:, tiny_sampler.VOCAB :] = -np.inf, -np.inf
      x0 = logits.argmax(-1)
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      conf = np.where(masked, (probs / probs.sum(-1, keepdims=True))[np.arange(block), x0], -np.inf)
      rank = np.argsort(np.argsort(-conf, kind='stable'), kind='stable')
      commit = masked & ((rank < transfer[step]) | (s.threshold > 0) & (conf >= s.threshold))
      x[lo : lo + block] = np.where(commit, x0, x[lo : lo + block])
      steps[lo : lo + block][commit] = b * spb + step
    if eos_id is not None and eos_id in x[n : lo + block]:
      break
  return x[n : n + s.gen_length], steps[n : n + s.gen_length]


def _text(row, eos_id):
  row = list(row)
  return row[: row.index(eos_id)] if eos_id in row else row


@functools.lru_cache
def _reference(row, s, eos_id=None, steps=False):
  """sdar_reference of PROMPTS[row] (its tokens, or its commit steps), computed once per setting."""
  return _reference_both(row, s, eos_id)[int(steps)]


@functools.lru_cache
def _reference_both(row, s, eos_id=None):
  return sdar_reference(PROMPTS[row], s, eos_id)


@pytest.mark.parametrize(
  's, stop_at_eos',
  # SDAR's setting decodes with stop_at_eos, as test_stops_once_every_text_has_ended (one compile
  # for both, eos_id being an argument); here no text ends, so every block runs.
  [pytest.param(SDAR, True, marks=pytest.mark.slow), (FIXED, False)],  # ~22 s: its compile
  ids=['sdar_threshold', 'blocks_of_8_fixed_steps'],
)
def test_block_cache_matches_the_per_row_reference(s, stop_at_eos):
  """Token-identical, rows of any length; a cache off by one block (the prefill or a committed
  block's K/V written a block early or late, or not written) changes the tokens."""
  sampling = dataclasses.replace(s, cache='block', stop_at_eos=stop_at_eos)
  eos_id = tiny_sampler.VOCAB - 1
  got, ran = _decode(sampling, eos_id)
  want = np.stack([_reference(i, s) for i in range(len(PROMPTS))])
  assert not (want == eos_id).any()  # no text ends (stop_at_eos changes nothing).
  np.testing.assert_array_equal(got, want)
  # The trajectory: the step that committed each token (TraceRL's rollout record).
  want_steps = np.stack([_reference(i, s, steps=True) for i in range(len(PROMPTS))])
  np.testing.assert_array_equal(_decode.steps, want_steps)
  assert not (got == tiny_sampler.MASK).any()
  assert ran == -(-(BLOCK_SIZE - 1 + s.gen_length) // s.block_length)  # a tail needs one more.


def test_stops_once_every_text_has_ended():
  """With stop_at_eos the block loop ends after the block where the last text ends: fewer blocks
  than gen_length holds, the same texts as the reference."""
  free = [_reference(i, SDAR) for i in range(len(PROMPTS))]
  # As EOS, the token most rows write in their first 10; the batch: those rows.
  early = [set(row[:10].tolist()) for row in free]
  eos_id = max(range(4, tiny_sampler.VOCAB), key=lambda t: (sum(t in e for e in early), -t))
  rows = [i for i, e in enumerate(early) if eos_id in e]
  assert len(rows) >= 2, free
  prompts, free = [PROMPTS[i] for i in rows], [free[i] for i in rows]
  sampling = dataclasses.replace(SDAR, cache='block', stop_at_eos=True)
  got, ran = _decode(sampling, eos_id, prompts)
  for i, row, ref in zip(rows, got, free):
    want = _reference(i, SDAR, eos_id)
    assert _text(row, eos_id) == _text(want, eos_id) == _text(ref, eos_id)
    assert not (row == tiny_sampler.MASK).any()  # what stayed masked after the EOS reads as EOS.
  # Each row's text ends in block (its prompt rest + the EOS index) // block_length.
  last = max(
    (len(p) % BLOCK_SIZE + len(_text(r, eos_id))) // SDAR.block_length
    for p, r in zip(prompts, free)
  )
  assert ran == last + 1 < SDAR.gen_length // SDAR.block_length


def test_block_decoding_refusals():
  model_config, params = tiny_sampler.model()  # bidirectional
  module = model_lib.merge(model_config, params)
  prompt_BP, lengths_B = prompt_rows.pad_prompts(PROMPTS[:2], tiny_sampler.PAD)
  kwargs = dict(mask_id=tiny_sampler.MASK, eos_id=tiny_sampler.VOCAB - 1, pad_id=tiny_sampler.PAD)
  block = dataclasses.replace(SDAR, cache='block')
  with pytest.raises(ValueError, match="exact only for causal or block_causal.*cache='none'"):
    sampler.decode_blocks(module, prompt_BP, lengths_B, block, jax.random.key(0), **kwargs)
