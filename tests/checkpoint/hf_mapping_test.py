"""The param <-> Hugging Face mapping: exact round trips, layouts, vocab rows, clear refusals."""

import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_mapping
from tests.checkpoint import tiny_run


def _setup(**overrides):
  config = tiny_run.tiny_config(**overrides)
  return config, model_lib.ModelConfig.from_config(config), tiny_run.random_params(config)


def _export(params, cfg, rows=None):
  return dict(hf_mapping.export_tensors(params, cfg, vocab_rows=rows or cfg.vocab_size))


@pytest.mark.parametrize('tie', [False, True])
def test_round_trip_is_exact(tie):
  config, cfg, params = _setup(**{'model.tie_embeddings': tie})
  tensors = _export(params, cfg)
  assert ('lm_head.weight' in tensors) != tie
  back = hf_mapping.import_params(
    hf_mapping.DictSource(tensors), 'qwen3', cfg, vocab_size=config.model.vocab_size
  )
  tiny_run.assert_same_params(params, back)


def test_entries_list_every_tensor_in_order():
  _, cfg, params = _setup()
  entries = hf_mapping.export_entries(cfg, vocab_rows=cfg.vocab_size)
  got = [(n, a.shape) for n, a in hf_mapping.export_tensors(params, cfg, vocab_rows=cfg.vocab_size)]
  assert got == entries
  assert len(entries) == 2 + 1 + 11 * cfg.num_layers  # embed, norm, head + 11 per layer


def test_layouts_follow_nn_linear():
  """q_proj.weight[n*H + h, d] = ours[d, n, h]; o_proj.weight[d, n*H + h] = ours[n, h, d]."""
  _, cfg, params = _setup()
  t = _export(params, cfg)
  q, o = params['blocks']['attn']['q_proj'][1], params['blocks']['attn']['o_proj'][1]
  n, h, d = 3, 5, 7
  assert t['model.layers.1.self_attn.q_proj.weight'][n * cfg.head_dim + h, d] == q[d, n, h]
  assert t['model.layers.1.self_attn.o_proj.weight'][d, n * cfg.head_dim + h] == o[n, h, d]
  assert t['model.layers.1.self_attn.k_proj.weight'].shape == (
    cfg.num_kv_heads * cfg.head_dim,
    cfg.d_model,
  )
  np.testing.assert_array_equal(
    t['model.layers.0.mlp.down_proj.weight'], params['blocks']['mlp']['down_proj'][0].T
  )
  np.testing.assert_array_equal(t['lm_head.weight'], params['lm_head'].T)


def test_vocab_rows_pad_and_trim():
  config, cfg, params = _setup(**{'model.vocab_size': 250})  # padded to 256
  tensors = _export(params, cfg, rows=250)
  assert tensors['model.embed_tokens.weight'].shape == (250, cfg.d_model)
  back = hf_mapping.import_params(hf_mapping.DictSource(tensors), 'qwen3', cfg, vocab_size=250)
  assert back['embed_tokens'].shape == (256, cfg.d_model)
  np.testing.assert_array_equal(back['embed_tokens'][:250], params['embed_tokens'][:250])
  assert not back['embed_tokens'][250:].any() and not back['lm_head'][:, 250:].any()
  # More rows than our padded vocab: the extra rows lie beyond the tokenizer and are dropped.
  big = dict(tensors)
  for name in ('model.embed_tokens.weight', 'lm_head.weight'):
    big[name] = np.concatenate([tensors[name], np.ones((20, cfg.d_model), np.float32)])
  back = hf_mapping.import_params(hf_mapping.DictSource(big), 'qwen3', cfg, vocab_size=250)
  np.testing.assert_array_equal(back['embed_tokens'][:250], params['embed_tokens'][:250])
  with pytest.raises(hf_mapping.MappingError, match='fewer than the 256 tokens'):
    hf_mapping.import_params(hf_mapping.DictSource(tensors), 'qwen3', cfg, vocab_size=256)


def test_missing_misshaped_and_unknown_tensors_are_named():
  config, cfg, params = _setup()
  tensors = _export(params, cfg)
  vocab = config.model.vocab_size
  broken = {k: v for k, v in tensors.items() if k != 'model.layers.1.mlp.up_proj.weight'}
  with pytest.raises(hf_mapping.MappingError, match=r'model\.layers\.1\.mlp\.up_proj\.weight'):
    hf_mapping.import_params(hf_mapping.DictSource(broken), 'qwen3', cfg, vocab_size=vocab)
  broken = dict(tensors, **{'model.layers.0.self_attn.k_proj.weight': np.zeros((8, 64))})
  with pytest.raises(
    hf_mapping.MappingError,
    match=r'k_proj\.weight has shape \(8, 64\), '
    r'expected \(32, 64\)',
  ):
    hf_mapping.import_params(hf_mapping.DictSource(broken), 'qwen3', cfg, vocab_size=vocab)
  broken = dict(tensors, **{'model.layers.2.mlp.up_proj.weight': np.zeros(1)})
  with pytest.raises(hf_mapping.MappingError, match='does not know: model.layers.2'):
    hf_mapping.import_params(hf_mapping.DictSource(broken), 'qwen3', cfg, vocab_size=vocab)
  ignored = dict(tensors, **{'model.layers.0.self_attn.rotary_emb.inv_freq': np.zeros(8)})
  hf_mapping.import_params(hf_mapping.DictSource(ignored), 'qwen3', cfg, vocab_size=vocab)
  with pytest.raises(hf_mapping.MappingError, match='unknown architecture'):
    hf_mapping.import_params(hf_mapping.DictSource(tensors), 'gpt2', cfg, vocab_size=vocab)


def _without_qk_norm(tensors):
  return {k: v for k, v in tensors.items() if '_norm.weight' not in k or 'layernorm' in k}


def test_models_without_qk_norm_are_refused_unless_asked():
  config, cfg, params = _setup()
  tensors = _without_qk_norm(_export(params, cfg))
  with pytest.raises(hf_mapping.MappingError, match='llama has no QK-norm'):
    hf_mapping.import_params(hf_mapping.DictSource(tensors), 'llama', cfg, vocab_size=256)
  back = hf_mapping.import_params(
    hf_mapping.DictSource(tensors), 'llama', cfg, vocab_size=256, missing_qk_norm='ones'
  )
  np.testing.assert_array_equal(back['blocks']['attn']['q_norm']['scale'], 1.0)
  np.testing.assert_array_equal(
    back['blocks']['attn']['q_proj'], params['blocks']['attn']['q_proj']
  )
  del config


def test_qwen2_biases_map_both_ways():
  """q/k/v biases [N or K, H] <-> q/k/v_proj.bias [N*H or K*H], head-major; no QK-norm tensors."""
  config, cfg, params = _setup(**{'model.qk_norm': False, 'model.qkv_bias': True})
  tensors = _export(params, cfg)
  assert not any('_norm.weight' in n and 'layernorm' not in n for n in tensors)
  bias = tensors['model.layers.1.self_attn.k_proj.bias']
  np.testing.assert_array_equal(bias.reshape(2, 16), params['blocks']['attn']['k_bias'][1])
  names = [n for n, _ in hf_mapping.export_entries(cfg, vocab_rows=cfg.vocab_size)]
  assert names == list(tensors)
  assert len(names) == 3 + 12 * cfg.num_layers  # 9 weights, 3 biases per layer
  back = hf_mapping.import_params(
    hf_mapping.DictSource(tensors), 'qwen2', cfg, vocab_size=config.model.vocab_size
  )
  tiny_run.assert_same_params(params, back)
  del tensors['model.layers.0.self_attn.q_proj.bias']
  with pytest.raises(hf_mapping.MappingError, match=r'layers\.0\.self_attn\.q_proj\.bias'):
    hf_mapping.import_params(hf_mapping.DictSource(tensors), 'qwen2', cfg, vocab_size=256)


def test_biases_without_a_slot_must_be_zero():
  _, cfg, params = _setup(**{'model.qk_norm': False})
  tensors = _export(params, cfg)
  for i in range(cfg.num_layers):
    for s in 'qkvo':
      tensors[f'model.layers.{i}.self_attn.{s}_proj.bias'] = np.zeros(16 * (2 if s in 'kv' else 4))
  hf_mapping.import_params(hf_mapping.DictSource(tensors), 'llama', cfg, vocab_size=256)
  tensors['model.layers.1.self_attn.o_proj.bias'][3] = 0.5
  with pytest.raises(
    hf_mapping.MappingError,
    match=r'layers\.1\.self_attn\.o_proj\.bias is non-zero \(max \|b\| = 0\.5\)',
  ):
    hf_mapping.import_params(hf_mapping.DictSource(tensors), 'llama', cfg, vocab_size=256)


def test_llada_names():
  _, cfg, params = _setup()
  rename = {
    'model.embed_tokens.weight': 'model.transformer.wte.weight',
    'model.norm.weight': 'model.transformer.ln_f.weight',
    'lm_head.weight': 'model.transformer.ff_out.weight',
  }
  suffixes = {
    'input_layernorm': 'attn_norm',
    'post_attention_layernorm': 'ff_norm',
    'self_attn.o_proj': 'attn_out',
    'mlp.gate_proj': 'ff_proj',
    'mlp.up_proj': 'up_proj',
    'mlp.down_proj': 'ff_out',
    'self_attn.q_proj': 'q_proj',
    'self_attn.k_proj': 'k_proj',
    'self_attn.v_proj': 'v_proj',
  }
  llada = {}
  for name, value in _without_qk_norm(_export(params, cfg)).items():
    if name in rename:
      llada[rename[name]] = value
      continue
    i, rest = name[len('model.layers.') :].split('.', 1)
    llada[f'model.transformer.blocks.{i}.{suffixes[rest[: -len(".weight")]]}.weight'] = value
  back = hf_mapping.import_params(
    hf_mapping.DictSource(llada), 'llada', cfg, vocab_size=256, missing_qk_norm='ones'
  )
  for key in ('gate_proj', 'up_proj', 'down_proj'):
    np.testing.assert_array_equal(back['blocks']['mlp'][key], params['blocks']['mlp'][key])
  np.testing.assert_array_equal(back['lm_head'], params['lm_head'])
