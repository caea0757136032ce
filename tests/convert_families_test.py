"""Qwen2 and Llama in and out exactly: transformers' own random-weight models imported through
`convert from-hf` and `load_pretrained` give their logits (bidirectional attention, fp32), and the
export goes back into transformers' own class, re-importing bit-exact."""

import json
import os

import numpy as np
import pytest

from dlmjax import convert
from dlmjax import inference
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from tests.checkpoint import family_dirs
from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

FAMILIES = family_dirs.TRANSFORMERS_FAMILIES
_transformers_dir = family_dirs.transformers_dir


def _theirs(hf_dir: str, tokens, class_name: str):
  from dlmjax.checkpoint import torch_reference  # pylint: disable=import-outside-toplevel

  model = torch_reference.transformers_model(hf_dir)  # bidirectional: modeling_dlmjax's class
  assert isinstance(model, getattr(transformers, class_name))
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()


def _ours(config, params, tokens):
  cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(cfg, params)(tokens))


def _close(theirs, ours):
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(ours).max())


def _restored(step_dir):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(step_dir)
  config = run_dir_lib.load_run_config(run_dir)
  return config, params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_transformers_model_imports_exports_and_reloads_exactly(tmp_path, family):
  _, class_name, kwargs = FAMILIES[family]
  hf_dir = _transformers_dir(tmp_path / 'hf', family)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  theirs = _theirs(hf_dir, tokens, class_name)

  # Import through the command line: the family's options, dims and special ids.
  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  config, params = _restored(run_dir)
  m = config.model
  assert (m.qk_norm, m.qkv_bias) == (False, family == 'qwen2')
  assert (m.rope_theta, m.norm_eps, m.tie_embeddings) == (
    kwargs['rope_theta'],
    kwargs['rms_norm_eps'],
    kwargs['tie_word_embeddings'],
  )
  assert (m.vocab_size, m.eos_token_id, m.pad_token_id, m.head_dim) == (256, 2, 1, 16)
  step_dir = run_dir_lib.resolve_step_dir(run_dir)[1]
  assert step_meta.read_meta(step_dir)['source'] == dict(
    family=family, path=os.path.abspath(hf_dir)
  )
  if family == 'qwen2':
    assert np.abs(params['blocks']['attn']['k_bias']).min() > 0  # the biases came across
  _close(theirs, _ours(config, params, tokens))

  # And straight from the directory, as inference does.
  pretrained = inference.load_pretrained(hf_dir)
  _close(theirs, _ours(pretrained.config, pretrained.params, tokens))

  # Export back: the family's layout, loaded by its own transformers class, the same logits.
  out = str(tmp_path / 'out')
  argv = ['to-hf', '--checkpoint-path', run_dir, '--output-dir', out, '--dtype', 'fp32']
  assert convert.main(argv) == 0
  with open(os.path.join(out, 'config.json')) as f:
    exported = json.load(f)
  assert (exported['model_type'], exported['architectures']) == (family, [class_name])
  names = set(safetensors_io.SafetensorsReader(out).keys())
  assert ('model.layers.1.self_attn.v_proj.bias' in names) is (family == 'qwen2')
  assert not any('q_norm' in n or 'o_proj.bias' in n for n in names)
  _close(theirs, _theirs(out, tokens, class_name))

  # Re-importing the export is bit-exact, and so is the .pt round trip.
  back_config, back = _restored(hf_io.checkpoint_from_hf(out, str(tmp_path / 'back')))
  tiny_run.assert_same_params(params, back)
  assert back_config.model == config.model
  pt = hf_io.torch_from_checkpoint(run_dir, str(tmp_path / 'model.pt'))
  back_config, back = _restored(hf_io.checkpoint_from_torch(pt, str(tmp_path / 'back_pt')))
  tiny_run.assert_same_params(params, back)
  assert back_config.model == config.model


def test_init_from_a_qwen2_directory_adopts_its_attention_options(tmp_path):
  from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel

  hf_dir = _transformers_dir(tmp_path / 'hf', 'qwen2')
  config = tiny_run.tiny_config(**{'init_from': hf_dir})
  changed = init_from.adopt_source_config(config)
  assert {'model.qk_norm=False', 'model.qkv_bias=True', 'model.rope_theta=1000000.0'} <= set(
    changed
  )
  _, params = hf_io.load_hf(hf_dir, config=config)  # what init_from restores: checked, exact
  tiny_run.assert_same_params(hf_io.load_hf(hf_dir)[1], params)


def test_qwen2_without_its_biases_or_with_a_qk_norm_is_another_function(tmp_path):
  """The parity above can fail: zeroing the imported biases, or importing into a QK-norm model
  (--missing-qk-norm=ones), moves the logits far past the tolerance."""
  hf_dir = _transformers_dir(tmp_path / 'hf', 'qwen2')
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  theirs = _theirs(hf_dir, tokens, 'Qwen2ForCausalLM')
  config, params = hf_io.load_hf(hf_dir)
  params = {**params, 'blocks': {**params['blocks'], 'attn': dict(params['blocks']['attn'])}}
  for name in ('q_bias', 'k_bias', 'v_bias'):
    params['blocks']['attn'][name] = np.zeros_like(params['blocks']['attn'][name])
  with pytest.raises(AssertionError):
    _close(theirs, _ours(config, params, tokens))
  config, params = hf_io.load_hf(hf_dir, missing_qk_norm='ones')
  assert config.model.qk_norm and config.model.qkv_bias
  with pytest.raises(AssertionError):
    _close(theirs, _ours(config, params, tokens))


# Llama-3.1's rope_scaling with original_max_position_embeddings shrunk to the tiny model's
# lengths, so each band holds a frequency the 32-token test turns far: head_dim 16 at theta 5e5
# has wavelengths 6.3 (< 64 / 4: kept), 32.4 (interpolated) and 167 and up (> 64: / factor).
_LLAMA3_SCALING = dict(
  rope_type='llama3',
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=64,
)


def test_llama3_rope_scaling_imports_computes_and_exports_exactly(tmp_path):
  hf_dir = _transformers_dir(tmp_path / 'hf', 'llama', rope_scaling=_LLAMA3_SCALING)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  theirs = _theirs(hf_dir, tokens, 'LlamaForCausalLM')

  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  config, params = _restored(run_dir)
  assert config.model.rope_scaling == (
    'llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=64'
  )
  _close(theirs, _ours(config, params, tokens))
  # Dropping the scaling (plain Llama-3 RoPE) is another function: the parity above can fail.
  config.model.rope_scaling = ''
  with pytest.raises(AssertionError):
    _close(theirs, _ours(config, params, tokens))

  out = str(tmp_path / 'out')
  argv = ['to-hf', '--checkpoint-path', run_dir, '--output-dir', out, '--dtype', 'fp32']
  assert convert.main(argv) == 0
  with open(os.path.join(out, 'config.json')) as f:
    exported = json.load(f)
  assert exported['rope_parameters'] == dict(_LLAMA3_SCALING, rope_theta=5e5)
  _close(theirs, _theirs(out, tokens, 'LlamaForCausalLM'))
  back_config, _ = _restored(hf_io.checkpoint_from_hf(out, str(tmp_path / 'back')))
  assert back_config.model.rope_scaling == _restored(run_dir)[0].model.rope_scaling


@pytest.mark.parametrize(
  'rope_scaling,named',
  [
    (dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=32), 'yarn'),
    (dict(rope_type='dynamic', factor=2.0), 'dynamic'),
  ],
)
def test_rope_types_without_a_formula_are_refused_by_name(rope_scaling, named):
  from dlmjax.checkpoint import hf_config  # pylint: disable=import-outside-toplevel

  hf = dict(FAMILIES['llama'][2], model_type='llama', rope_scaling=rope_scaling)
  with pytest.raises(hf_config.HFConfigError, match=f"type '{named}' is not supported"):
    hf_config.config_from_hf(hf)
