"""LLaDA in exactly: a tiny random-weight LLaDA directory, laid out as GSAI-ML/LLaDA-8B-* ships it
(config.json of LLaDAConfig's fields, model_type 'llada'; sharded safetensors named
model.transformer.*), imported through `convert from-hf`, `hf_io.load_hf` and `load_pretrained`,
gives the logits of a plain PyTorch forward written here from LLaDA's published formulas.

The reference follows modeling_llada.py's LLaDALlamaBlock (read, not copied; no transformers):
  x = wte[ids]; per block: x += attn_out(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))) with
  n = RMSNorm(x) * attn_norm.weight; x += ff_out(silu(ff_proj(m)) * up_proj(m)) with
  m = RMSNorm(x) * ff_norm.weight; logits = (RMSNorm(x) * ln_f.weight) @ (ff_out | wte).T.
  RMSNorm: x * rsqrt(mean(x^2) + rms_norm_eps), gain only (no bias). RoPE: rotate-half
  (cat(-x2, x1) over the two halves of each head), inv_freq = theta^(-arange(0, H, 2) / H), H =
  d_model / n_heads. Attention: softmax(q k^T / sqrt(H)) with no mask (bidirectional; LLaDA passes
  is_causal=False), k/v heads repeat_interleave'd to the q heads (GQA). q/k/v_proj carry a bias
  only with include_qkv_bias (attn_out, ff_* and the norms never do here; include_bias is refused).
"""

import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import convert
from dlmjax import inference
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from tests.checkpoint import family_dirs, references
from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
safetensors_torch = pytest.importorskip('safetensors.torch')

_LLADA_CONFIG = family_dirs.LLADA_CONFIG
VARIANTS = family_dirs.LLADA_VARIANTS
_llada_dir = family_dirs.llada_dir


def _ours(config, params, tokens):
  cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(cfg, params)(tokens))


def _restored(run_dir):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(run_dir)
  config = run_dir_lib.load_run_config(run_dir)
  return config, params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_llada_directory_imports_to_llada_function(tmp_path, variant):
  hf_dir, hf, sd = _llada_dir(tmp_path / 'llada', variant)
  tokens = np.random.default_rng(1).integers(0, hf['vocab_size'], (2, 24))
  theirs = references.llada_reference(sd, hf, tokens)

  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  config, params = _restored(run_dir)
  m = config.model
  assert (m.qk_norm, m.qkv_bias, m.tie_embeddings) == (
    False,
    hf['include_qkv_bias'],
    hf['weight_tying'],
  )
  assert (m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_dim) == (4, hf['n_kv_heads'], 16, 96)
  assert (m.rope_theta, m.norm_eps, m.attention_mask) == (500000.0, 1e-5, 'bidirectional')
  assert (m.vocab_size, m.mask_token_id, m.eos_token_id, m.pad_token_id) == (
    hf['vocab_size'],
    hf['mask_token_id'],
    2,
    2,
  )
  step_dir = run_dir_lib.resolve_step_dir(run_dir)[1]
  assert step_meta.read_meta(step_dir)['source']['family'] == 'llada'
  references.assert_close(theirs, _ours(config, params, tokens))

  _, params = hf_io.load_hf(hf_dir)
  references.assert_close(theirs, _ours(config, params, tokens))
  pretrained = inference.load_pretrained(hf_dir)
  references.assert_close(theirs, _ours(pretrained.config, pretrained.params, tokens))


@pytest.mark.parametrize(
  'wrong', ['swap_gate_up', 'interleaved_rope', 'drop_bias'], ids=lambda w: w
)
def test_the_parity_sees_a_wrong_detail(tmp_path, wrong):
  """The comparison above can fail: LLaDA with ff_proj/up_proj swapped, interleaved RoPE or its
  q/k/v biases dropped is far past the tolerance from what the import computes."""
  hf_dir, hf, sd = _llada_dir(tmp_path / 'llada', 'gqa_tied_qkv_bias_padded')
  tokens = np.random.default_rng(1).integers(0, hf['vocab_size'], (2, 24))
  config, params = hf_io.load_hf(hf_dir)
  ours = _ours(config, params, tokens)
  references.assert_close(references.llada_reference(sd, hf, tokens), ours)
  with pytest.raises(AssertionError):
    references.assert_close(references.llada_reference(sd, hf, tokens, **{wrong: True}), ours)


@pytest.mark.parametrize(
  'change, named',
  [
    (dict(include_bias=True), 'include_bias=True'),
    (dict(activation_type='swiglu'), "activation_type='swiglu'"),
    (dict(layer_norm_type='default'), "layer_norm_type='default'"),
    (dict(layer_norm_with_affine=False), 'layer_norm_with_affine=False'),
    (dict(bias_for_layer_norm=True), 'bias_for_layer_norm=true'),
    (dict(block_group_size=4), 'block_group_size=4'),
    (dict(scale_logits=True), 'scale_logits=True'),
    (dict(attention_layer_norm=True), 'attention_layer_norm=true'),
    (dict(rope=False), 'rope=False'),
  ],
)
def test_llada_features_we_cannot_compute_are_refused_by_name(tmp_path, change, named):
  hf_dir, hf, _ = _llada_dir(tmp_path / 'llada', 'llada_8b_like')
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(dict(hf, **change), f)
  with pytest.raises(hf_config.HFConfigError, match=named.replace('(', r'\(')):
    hf_io.load_hf(hf_dir)


def test_absent_llada_fields_mean_llada_defaults():
  """LLaDAConfig fills absent fields from its ModelConfig: weight_tying defaults to True, a
  missing `rope` means no RoPE (refused), embedding_size defaults to 50304."""
  hf = dict(_LLADA_CONFIG)
  del hf['weight_tying'], hf['embedding_size']
  config = hf_config.config_from_hf(hf)
  assert config.model.tie_embeddings
  assert hf_config.embedding_rows(hf, 'llada') == 50304
  del hf['rope']
  with pytest.raises(hf_config.HFConfigError, match='rope=False'):
    hf_config.config_from_hf(hf)


def test_llada_8b_config_imports_as_the_llada_8b_preset():
  """GSAI-ML/LLaDA-8B-Instruct's config.json sizes and ids read into exactly the preset."""
  hf = dict(
    _LLADA_CONFIG,
    d_model=4096,
    n_heads=32,
    n_kv_heads=32,
    n_layers=32,
    mlp_hidden_size=12288,
    mlp_ratio=4,
    vocab_size=126464,
    embedding_size=126464,
    max_sequence_length=4096,
    mask_token_id=126336,
    eos_token_id=126081,
    pad_token_id=126081,
  )
  config = hf_config.config_from_hf(hf)
  preset = model_lib.PRESETS['llada_8b']
  assert {k: config.model[k] for k in preset} == preset
  assert hf_config.embedding_rows(hf, 'llada') == 126464


def test_init_from_a_llada_directory_adopts_its_model(tmp_path):
  from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel

  hf_dir, _, _ = _llada_dir(tmp_path / 'llada', 'gqa_tied_qkv_bias_padded')
  config = config_lib.defaults()  # every model key at its default: all come from LLaDA's
  config.init_from = hf_dir
  changed = set(init_from.adopt_source_config(config))
  assert {'model.ffn_dim=96', 'model.vocab_size=200', 'model.tie_embeddings=True'} <= changed
  assert {'model.qk_norm=False', 'model.qkv_bias=True', 'model.rope_theta=500000.0'} <= changed
  _, params = hf_io.load_hf(hf_dir, config=config)  # what init_from restores: checked, exact
  tiny_run.assert_same_params(hf_io.load_hf(hf_dir)[1], params)
