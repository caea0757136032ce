"""load_pretrained: run, step and Hugging Face directories give the model's logits."""

import numpy as np
import pytest

import dlmjax
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from tests.checkpoint import tiny_run


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('inference')
  config, params, step_dir = tiny_run.make_run(root / 'run', **{'model.vocab_size': 250})
  tokens = np.random.default_rng(0).integers(0, 250, (2, 16))
  expected = np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))
  return root, step_dir, tokens, expected[..., :250]


def test_run_and_step_directories(run):
  root, step_dir, tokens, expected = run
  for path in (root / 'run', step_dir):
    model = dlmjax.load_pretrained(str(path))
    logits = model.logits(tokens)
    assert logits.dtype == np.float32 and logits.shape == (2, 16, 250)  # the tokenizer's vocab
    np.testing.assert_allclose(logits, expected, atol=1e-5)
  assert model.config.model.vocab_size == 250 and model.params['embed_tokens'].shape[0] == 256


def test_hugging_face_directory(run, tmp_path):
  root, _, tokens, expected = run
  hf_dir = hf_io.hf_from_checkpoint(
    str(root / 'run'), str(tmp_path / 'hf'), dtype='fp32', trim_vocab=True
  )
  model = dlmjax.load_pretrained(hf_dir)
  np.testing.assert_allclose(model.logits(tokens), expected, atol=1e-5)
  bf16 = dlmjax.load_pretrained(hf_dir, dtype='bf16')
  assert bf16.config.model.dtype == 'bfloat16'
  np.testing.assert_allclose(bf16.logits(tokens), expected, atol=0.05 * np.abs(expected).max())


def test_bad_tokens_are_refused(run):
  root, _, tokens, _ = run
  model = dlmjax.load_pretrained(str(root / 'run'))
  with pytest.raises(ValueError, match=r'\[0, 250\)'):
    model.logits(tokens + 240)
  with pytest.raises(ValueError, match='shaped'):
    model.logits(tokens[0])
