"""The PyTorch forwards used by verify agree with our JAX model for every mask kind."""

import json

import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import safetensors_io
from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
from dlmjax.checkpoint import torch_reference  # noqa: E402  pylint: disable=wrong-import-position


def _export(tmp_path, **overrides):
  config = tiny_run.tiny_config(**overrides)
  params = tiny_run.random_params(config)
  hf_io.write_hf(str(tmp_path), config, params, dtype='fp32')
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
  ours = np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))
  return tokens, ours


@pytest.mark.parametrize('kind', ['bidirectional', 'causal', 'block_causal'])
def test_reference_matches_jax(tmp_path, kind):
  tokens, ours = _export(tmp_path, **{'model.attention_mask': kind, 'model.block_size': 4})
  reader = safetensors_io.SafetensorsReader(str(tmp_path))
  state = {k: torch.from_numpy(reader.get(k)) for k in reader.keys()}
  hf = json.loads((tmp_path / 'config.json').read_text())
  theirs = torch_reference.Reference(hf, state)(torch.as_tensor(tokens)).numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-5)


def test_transformers_honours_the_mask_kind(tmp_path):
  pytest.importorskip('transformers')
  tokens, ours = _export(
    tmp_path, **{'model.attention_mask': 'block_causal', 'model.block_size': 4}
  )
  model = torch_reference.transformers_model(str(tmp_path))
  with torch.no_grad():
    theirs = model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-5)
