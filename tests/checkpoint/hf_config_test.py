"""Hugging Face configs: architecture detection, dims both ways, clear refusals."""

import pytest

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_config
from tests.checkpoint import tiny_run

# MegaDLMs' DiffLM template (hf_configs/*_dlm/config.json): no model_type and no head_dim.
DIFFLM = dict(
  architectures=['DiffLM'],
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=4,
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
  tie_word_embeddings=False,
  vocab_size=256,
  max_position_embeddings=64,
  eos_token_id=0,
  mask_token_id=250,
  attn_mask_type='bidirectional',
  hidden_act='silu',
)
LLADA = dict(
  architectures=['LLaDAModelLM'],
  model_type='llada',
  d_model=64,
  n_heads=4,
  n_kv_heads=4,
  n_layers=2,
  mlp_hidden_size=96,
  vocab_size=250,
  embedding_size=256,
  rope_theta=500000.0,
  rms_norm_eps=1e-5,
  weight_tying=False,
  mask_token_id=249,
  block_type='llama',
  layer_norm_type='rms',
  activation_type='silu',
  attention_layer_norm=False,
  include_bias=False,
  rope=True,
  max_sequence_length=1024,
)


@pytest.mark.parametrize(
  'hf, arch',
  [
    (dict(model_type='qwen3', architectures=['Qwen3ForCausalLM']), 'qwen3'),
    (DIFFLM, 'difflm'),
    (dict(model_type='qwen2'), 'qwen2'),
    (dict(model_type='llama', architectures=['LlamaForCausalLM']), 'llama'),
    (LLADA, 'llada'),
  ],
)
def test_detects_architectures(hf, arch):
  assert hf_config.detect_architecture(hf) == arch


def test_unknown_architecture_lists_the_known_ones():
  with pytest.raises(hf_config.HFConfigError, match='qwen3, difflm, qwen2, llama, llada'):
    hf_config.detect_architecture(dict(model_type='gpt2', architectures=['GPT2LMHeadModel']))


def test_export_config_reads_back_to_the_same_model():
  config = tiny_run.tiny_config(**{'model.tie_embeddings': True, 'model.mask_token_id': 7})
  hf = hf_config.to_hf(config, vocab_rows=256, dtype='bf16')
  assert (hf['model_type'], hf['architectures']) == ('qwen3', ['Qwen3ForCausalLM'])
  assert 'torch_dtype' not in hf  # transformers 5 names it `dtype` (torch_dtype is deprecated)
  assert (hf['mask_token_id'], hf['attn_mask_type'], hf['dtype']) == (
    7,
    'bidirectional',
    'bfloat16',
  )
  assert hf['max_position_embeddings'] == config.model.seq_len
  back = hf_config.config_from_hf(hf)
  for key in (
    'num_layers',
    'd_model',
    'num_heads',
    'num_kv_heads',
    'head_dim',
    'ffn_dim',
    'vocab_size',
    'rope_theta',
    'norm_eps',
    'tie_embeddings',
    'mask_token_id',
    'seq_len',
    'attention_mask',
  ):
    assert back.model[key] == config.model[key], key
  hf_config.check_matches(hf, config)


def test_difflm_and_llada_dims():
  c = hf_config.config_from_hf(DIFFLM)
  assert (c.model.head_dim, c.model.mask_token_id, c.model.eos_token_id) == (16, 250, 0)
  c = hf_config.config_from_hf(LLADA)
  assert (c.model.ffn_dim, c.model.head_dim, c.model.vocab_size, c.model.rope_theta) == (
    96,
    16,
    250,
    500000.0,
  )
  assert hf_config.embedding_rows(LLADA, 'llada') == 256
  assert config_lib.padded_vocab_size(c) == 256


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(rope_scaling=dict(rope_type='yarn', factor=4.0)), "rope_scaling type 'yarn'"),
    (dict(hidden_act='gelu'), 'SwiGLU'),
    (dict(attn_mask_type='sliding'), 'attn_mask_type'),
  ],
)
def test_unsupported_configs_are_refused(change, message):
  with pytest.raises(hf_config.HFConfigError, match=message):
    hf_config.config_from_hf(dict(DIFFLM, **change))


QWEN2 = dict(
  DIFFLM,
  architectures=['Qwen2ForCausalLM'],
  model_type='qwen2',
  rope_theta=1e6,
  tie_word_embeddings=True,
  use_sliding_window=False,
  sliding_window=32768,
  max_window_layers=2,
)
LLAMA = dict(
  {k: v for k, v in DIFFLM.items() if k not in ('mask_token_id', 'attn_mask_type')},
  architectures=['LlamaForCausalLM'],
  model_type='llama',
  rms_norm_eps=1e-5,
  rope_theta=5e5,
  attention_bias=False,
)


@pytest.mark.parametrize(
  'hf, qk_norm, qkv_bias',
  [(DIFFLM, True, False), (QWEN2, False, True), (LLAMA, False, False), (LLADA, False, False)],
)
def test_each_family_imports_with_its_attention_options(hf, qk_norm, qkv_bias):
  m = hf_config.config_from_hf(hf).model
  assert (m.qk_norm, m.qkv_bias) == (qk_norm, qkv_bias)
  if hf is QWEN2:
    assert (m.rope_theta, m.tie_embeddings, m.norm_eps) == (1e6, True, 1e-6)


@pytest.mark.parametrize(
  'hf, message',
  [
    # RoPE scalings without a formula here (llama3 and linear import: convert_families_test).
    (
      dict(LLAMA, rope_scaling=dict(rope_type='yarn', factor=4.0, beta_fast=32)),
      "rope_scaling type 'yarn' is not supported",
    ),
    (
      dict(LLAMA, rope_scaling=dict(rope_type='llama3', factor=8.0)),
      "'llama3' without low_freq_factor, high_freq_factor, original_max_position_embeddings",
    ),
    (dict(QWEN2, use_sliding_window=True), 'sliding-window attention'),
    (
      dict(QWEN2, layer_types=['full_attention', 'sliding_attention']),
      'sliding-window attention',
    ),
    (dict(LLAMA, attention_bias=True), "llama's o_proj then has a bias"),
  ],
)
def test_what_we_cannot_compute_is_refused_in_one_line(hf, message):
  with pytest.raises(hf_config.HFConfigError, match=message) as e:
    hf_config.config_from_hf(hf)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('family', ['qwen2', 'llama'])
def test_export_config_names_the_family(family):
  qkv_bias = family == 'qwen2'
  config = tiny_run.tiny_config(**{'model.qk_norm': False, 'model.qkv_bias': qkv_bias})
  hf = hf_config.to_hf(config, vocab_rows=256, dtype='fp32')
  assert (hf['model_type'], hf['architectures']) == (
    family,
    ['Qwen2ForCausalLM' if qkv_bias else 'LlamaForCausalLM'],
  )
  back = hf_config.config_from_hf(hf).model
  assert (back.qk_norm, back.qkv_bias) == (False, qkv_bias)
  hf_config.check_matches(hf, config)


def test_qk_norm_with_biases_has_no_family_to_export_to():
  config = tiny_run.tiny_config(**{'model.qkv_bias': True})
  with pytest.raises(hf_config.HFConfigError, match='no Hugging Face family'):
    hf_config.to_hf(config, vocab_rows=256, dtype='fp32')


def test_llada_qk_layer_norm_is_refused():
  with pytest.raises(hf_config.HFConfigError, match='all heads at once'):
    hf_config.config_from_hf(dict(LLADA, attention_layer_norm=True))


def test_check_matches_lists_differences():
  config = tiny_run.tiny_config(**{'model.ffn_dim': 96, 'model.num_kv_heads': 4})
  hf = hf_config.to_hf(tiny_run.tiny_config(), vocab_rows=256, dtype='fp32')
  with pytest.raises(
    hf_config.HFConfigError,
    match=r'num_kv_heads: checkpoint 2, config 4; '
    r'model\.ffn_dim: checkpoint 128, config 96',
  ):
    hf_config.check_matches(hf, config)


def test_llama3_rope_scaling_reads_and_writes_back():
  scaling = dict(
    rope_type='llama3',
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  )
  config = hf_config.config_from_hf(dict(LLAMA, rope_scaling=scaling))
  assert config.model.rope_scaling == (
    'llama3:factor=32,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192'
  )
  hf = hf_config.to_hf(config, vocab_rows=config.model.vocab_size, dtype='fp32')
  assert hf['rope_parameters'] == dict(scaling, rope_theta=config.model.rope_theta)
  assert hf['rope_scaling'] == scaling  # transformers v4 reads it here
  hf_config.check_matches(hf, config)
  config.model.rope_scaling = ''
  with pytest.raises(hf_config.HFConfigError, match='model.rope_scaling'):
    hf_config.check_matches(hf, config)
