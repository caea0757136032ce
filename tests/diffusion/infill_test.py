"""Infilling against a plain numpy statement of the loop (one most-confident hole per step), and
`generate --infill` end to end: tokens outside the holes never change, every hole is filled."""

import jax
import numpy as np
import pytest

from dlmjax import generate
from dlmjax import model as model_lib
from dlmjax.diffusion import infill
from dlmjax.diffusion import prompt_rows, sampling_config
from tests import evaluate_test
from tests.conftest import tiny_test_config

MASK, PAD, VOCAB = 3, 0, 100
CANVASES = [
  [5, MASK, MASK, 8, 9, MASK, 11],  # two holes in the middle
  [MASK, MASK, 22, 23],  # a hole at the start
  [30, 31, 32, MASK],  # a hole at the end (plain completion)
]


@pytest.fixture(scope='module')
def tiny():
  config = tiny_test_config(**{'model.vocab_size': VOCAB, 'model.init_std': 0.3})
  model_config = model_lib.ModelConfig.from_config(config)
  params = model_lib.init_params(model_config, jax.random.key(0))
  forward = jax.jit(
    lambda p, tokens, seg, pos: model_lib.merge(model_config, p)(
      tokens, segment_ids_BL=seg, positions_BL=pos
    )
  )
  return model_config, params, lambda *a: np.asarray(forward(params, *a), np.float64)


def reference(forward, canvas_BL, lengths_B, steps):
  """Per step: logits of the canvas, MASK and padded rows forbidden, and in each row the masked
  positions' greedy tokens committed, most confident first, n // steps per step (+1 early)."""
  x = np.array(canvas_BL)
  batch, length = x.shape
  offset = length - np.asarray(lengths_B)[:, None]
  index = np.arange(length)[None]
  seg, pos = (index >= offset).astype(np.int32), np.maximum(index - offset, 0)
  counts = [(x[b] == MASK).sum() for b in range(batch)]
  for step in range(steps):
    logits = forward(x, seg, pos)
    logits[..., VOCAB:] = -np.inf
    logits[..., MASK] = -np.inf
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for b in range(batch):
      k = counts[b] // steps + (step < counts[b] % steps)
      masked = np.flatnonzero(x[b] == MASK)
      conf = probs[b, masked].max(-1)
      for j in masked[np.argsort(-conf, kind='stable')[:k]]:
        x[b, j] = int(np.argmax(logits[b, j]))
  return x


def test_infill_matches_the_plain_loop_and_keeps_the_text(tiny):
  model_config, params, forward = tiny
  settings = sampling_config.SamplingConfig(gen_length=8, steps=2, block_length=8)  # 2+1 on row 0
  canvas_BL, lengths_B = prompt_rows.pad_prompts(CANVASES, PAD)
  fn = infill.make_infill_fn(model_config, settings, mask_id=MASK, vocab_size=VOCAB)
  out = np.asarray(fn(params, canvas_BL, lengths_B, jax.random.key(0)))
  np.testing.assert_array_equal(out, reference(forward, canvas_BL, lengths_B, 2))
  holes = canvas_BL == MASK
  np.testing.assert_array_equal(out[~holes], canvas_BL[~holes])  # text and pads unchanged
  assert not (out == MASK).any() and (out[holes] < VOCAB).all()  # every hole filled


def test_templates_and_bad_settings():
  encode = lambda text: [ord(c) for c in text]  # noqa: E731
  assert infill.template_tokens('ab<mask:2>c', encode, MASK) == [97, 98, MASK, MASK, 99]
  with pytest.raises(ValueError, match='no hole'):
    infill.template_tokens('abc', encode, MASK)
  with pytest.raises(ValueError, match='empty hole'):
    infill.template_tokens('a<mask:0>', encode, MASK)
  with pytest.raises(ValueError, match='cache none'):
    infill.check_settings(sampling_config.SamplingConfig(cache='dual'))


def test_generate_infill_fills_the_holes(tmp_path, capsys):
  run = evaluate_test.make_word_run(tmp_path / 'run', seq_len=32)
  code = generate.main(
    ['--checkpoint-path', str(run), '--infill', 'w1 w2 <mask:3> w7 <mask:2> w9']
    + ['--steps', '5', '--gen-length', '5', '--block-length', '5']  # the sampler's own checks
  )
  assert code == 0
  words = capsys.readouterr().out.split()
  assert len(words) == 9 and '<mask>' not in words
  assert words[:2] == ['w1', 'w2'] and words[5] == 'w7' and words[8] == 'w9'
