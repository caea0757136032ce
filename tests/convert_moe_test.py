"""Mixture-of-experts checkpoints in and out (docs/moe.md, Hugging Face checkpoints).

Qwen3-MoE: a tiny random-weight transformers Qwen3MoeForCausalLM (save_pretrained: the published
per-expert names) imports into a model whose logits are transformers' own forward with
bidirectional attention (fp32); the fused form of transformers 5's Qwen3MoeExperts
(gate_up_proj [E, 2F, D], down_proj [E, D, F]) imports to the same params; an export writes the
per-expert names back bit-exact and loads in transformers.

LLaDA-MoE: a directory laid out as modeling_lladamoe.py's LLaDAMoEModelLM names it (shared expert
included) imports into a model whose logits are a float64 forward written here from that file:
pre-norm layers, q/k RMSNorm per head before rotate-half RoPE, no mask, softmax router whose top-k
weights are the raw probabilities, SwiGLU experts, the shared expert added to every token.
"""

import json
import math
import os

import jax
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import safetensors_io
from tests.checkpoint import family_dirs, references

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
safetensors_torch = pytest.importorskip('safetensors.torch')

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 16))


def _ours(config, params, tokens=TOKENS):
  cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(cfg, params)(tokens))


def _close(theirs, ours):
  assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(theirs).max())


def _tensors(hf_dir):
  reader = safetensors_io.SafetensorsReader(hf_dir)
  return {name: np.asarray(reader.get(name)) for name in reader.keys()}


def _transformers_logits(hf_dir, tokens=TOKENS, *, plain=False, renormalise=None):
  """transformers' Qwen3MoeForCausalLM of the directory, every attention bidirectional (the
  config's is_causal for transformers' masks, the modules' for the attention kernels); plain:
  AutoModelForCausalLM as a user loads an export, whose config.json says is_causal=false;
  renormalise: the routers' norm_topk_prob set to it (the other router, for the mutation)."""
  if plain:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  else:
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(
      hf_dir, dtype=torch.float32, attn_implementation='eager'
    ).eval()
    model.config.is_causal = False
    for module in model.modules():
      if hasattr(module, 'is_causal'):
        module.is_causal = False
      if renormalise is not None and hasattr(module, 'norm_topk_prob'):
        module.norm_topk_prob = renormalise
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()


@pytest.fixture(scope='module')
def qwen3_moe(tmp_path_factory):
  """(directory, transformers' logits, our imported config and params, our logits)."""
  hf_dir = family_dirs.qwen3_moe_dir(tmp_path_factory.mktemp('qwen3_moe'))
  config, params = hf_io.load_hf(hf_dir)
  return hf_dir, _transformers_logits(hf_dir), config, params, _ours(config, params)


def test_qwen3_moe_imports_to_the_transformers_forward(qwen3_moe):
  hf_dir, theirs, config, _, ours = qwen3_moe
  m = config.model
  e = m.moe
  assert (e.num_experts, e.experts_per_token, e.ffn_dim, e.shared_experts) == (4, 2, 32, 0)
  assert (e.router, m.qk_norm, m.attention_mask, m.ffn_dim) == (
    'softmax_topk',
    True,
    'bidirectional',
    96,
  )
  _close(theirs, ours)
  # The parity can fail: the raw top-k weights (no renormalisation) are another function.
  with pytest.raises(AssertionError):
    _close(_transformers_logits(hf_dir, renormalise=False), ours)


def test_qwen3_moe_raw_router_and_fused_experts_import(qwen3_moe, tmp_path):
  """norm_topk_prob=false gives the raw router; transformers 5's fused expert tensors import to
  the per-expert form's params exactly."""
  hf_dir, _, config, params, _ = qwen3_moe
  raw = hf_config.config_from_hf(dict(hf_config.read(hf_dir), norm_topk_prob=False))
  assert raw.model.moe.router == 'softmax_topk_raw'
  tensors = _tensors(hf_dir)
  fused = {n: t for n, t in tensors.items() if '.experts.' not in n}
  for i in range(config.model.num_layers):
    p = f'model.layers.{i}.mlp.experts.'
    per = [[tensors[f'{p}{e}.{k}_proj.weight'] for e in range(4)] for k in ('gate', 'up', 'down')]
    fused[p + 'gate_up_proj'] = np.stack([np.concatenate(gu) for gu in zip(per[0], per[1])])
    fused[p + 'down_proj'] = np.stack(per[2])
  source = hf_mapping.DictSource(fused)
  cfg = model_lib.ModelConfig.from_config(config)
  back = hf_mapping.import_params(source, 'qwen3_moe', cfg, vocab_size=256)
  for path in (('blocks', 'mlp', 'gate_proj'), ('blocks', 'mlp', 'up_proj')):
    np.testing.assert_array_equal(
      back[path[0]][path[1]][path[2]], np.asarray(params[path[0]][path[1]][path[2]])
    )
  np.testing.assert_array_equal(
    back['blocks']['mlp']['down_proj'], np.asarray(params['blocks']['mlp']['down_proj'])
  )


def _export_bit_exact(hf_dir, config, params, tmp_path):
  """(the export's directory, its config.json) after checking its tensors are hf_dir's, bit for
  bit."""
  out = str(tmp_path / 'export')
  hf_io.write_hf(out, config, params, dtype='fp32', trim_vocab=True, source_family='qwen3_moe')
  original, exported = _tensors(hf_dir), _tensors(out)
  assert sorted(original) == sorted(exported)
  for name, tensor in original.items():
    np.testing.assert_array_equal(tensor, exported[name], err_msg=name)
  with open(os.path.join(out, 'config.json')) as f:
    return out, json.load(f)


def test_qwen3_moe_export_is_bit_exact_and_loads_in_transformers(qwen3_moe, tmp_path):
  hf_dir, theirs, config, params, _ = qwen3_moe
  out, written = _export_bit_exact(hf_dir, config, params, tmp_path)
  assert (written['model_type'], written['num_experts'], written['norm_topk_prob']) == (
    'qwen3_moe',
    4,
    True,
  )
  _close(theirs, _transformers_logits(out, plain=True))
  os.remove(os.path.join(out, hf_config.DLMJAX_CONFIG_FILE))
  derived, _ = hf_io.load_hf(out)
  for key in ('num_experts', 'experts_per_token', 'moe_ffn_dim', 'router', 'shared_experts'):
    assert config_lib.model_field(derived.model, key) == config_lib.model_field(config.model, key)


@pytest.fixture(scope='module')
def qwen3_moe_mixed(tmp_path_factory):
  """A 4-layer Qwen3-MoE with dense layers: decoder_sparse_step=2 leaves layers 0 and 2 dense,
  mlp_only_layers=[3] layer 3 too, so only layer 1 is sparse (runs: dense, MoE, dense x 2)."""
  hf_dir = family_dirs.qwen3_moe_dir(
    tmp_path_factory.mktemp('qwen3_moe_mixed'),
    num_hidden_layers=4,
    decoder_sparse_step=2,
    mlp_only_layers=[3],
  )
  config, params = hf_io.load_hf(hf_dir)
  return hf_dir, _transformers_logits(hf_dir), config, params, _ours(config, params)


def test_qwen3_moe_with_dense_layers_imports_and_exports_to_the_transformers_forward(
  qwen3_moe_mixed, tmp_path
):
  hf_dir, theirs, config, params, ours = qwen3_moe_mixed
  assert (config.model.moe.dense_layers, config.model.ffn_dim) == ('0,2,3', 96)
  assert sorted(k for k in params if k.startswith('blocks')) == ['blocks', 'blocks_1', 'blocks_2']
  assert params['blocks_2']['mlp']['gate_proj'].shape == (2, 64, 96)  # two dense layers stacked
  _close(theirs, ours)
  # The parity can fail: the same weights with the layer kinds read in another order (the
  # dense run's two layers swapped) are another function.
  swapped = dict(params, blocks_2=jax.tree.map(lambda v: v[::-1], params['blocks_2']))
  with pytest.raises(AssertionError):
    _close(theirs, _ours(config, swapped))

  out, written = _export_bit_exact(hf_dir, config, params, tmp_path)
  assert (written['decoder_sparse_step'], written['mlp_only_layers']) == (1, [0, 2, 3])
  _close(theirs, _transformers_logits(out, plain=True))
  os.remove(os.path.join(out, hf_config.DLMJAX_CONFIG_FILE))
  assert hf_io.load_hf(out)[0].model.moe.dense_layers == '0,2,3'


def test_dense_layer_patterns_derive_as_transformers_and_deepseek_lay_them_out():
  indices = hf_config.config_lib.dense_layer_indices
  assert indices(6, sparse_step=2) == '0,2,4'  # (i + 1) % 2 == 0 is sparse
  assert indices(6, sparse_step=3, mlp_only=[5]) == '0,1,3,4,5'
  assert indices(5, first_k_dense=2) == '0,1'
  assert indices(4) == ''
  hf = dict(family_dirs.QWEN3_MOE_CONFIG, model_type='qwen3_moe')
  for changes, dense in (
    (dict(num_hidden_layers=4, decoder_sparse_step=2), '0,2'),
    (dict(num_hidden_layers=1), ''),  # one sparse layer is no dense one
    (dict(num_hidden_layers=3, mlp_only_layers=[2, 0], decoder_sparse_step=None), '0,2'),
  ):
    assert hf_config.config_from_hf(dict(hf, **changes)).model.moe.dense_layers == dense, changes


def _refused(match, fn, *args, **kwargs):
  with pytest.raises(ValueError, match=match) as e:
    fn(*args, **kwargs)
  assert '\n' not in str(e.value)


def test_moe_checkpoints_we_cannot_compute_are_refused_in_one_line(qwen3_moe):
  hf_dir, _, config, _, _ = qwen3_moe
  hf = hf_config.read(hf_dir)
  _refused('every layer dense', hf_config.config_from_hf, dict(hf, mlp_only_layers=[0, 1]))
  _refused('decoder_sparse_step=0', hf_config.config_from_hf, dict(hf, decoder_sparse_step=0))
  _refused(
    'model.moe.dense_layers: checkpoint',
    hf_config.check_matches,
    dict(hf, mlp_only_layers=[1]),
    config,
  )
  _refused(
    'model.moe.num_experts: checkpoint 8', hf_config.check_matches, dict(hf, num_experts=8), config
  )
  llada = family_dirs.LLADA_MOE_CONFIG
  _refused('moe_layer_freq', hf_config.config_from_hf, dict(llada, moe_layer_freq=[0, 1]))
  _refused('clip_qkv', hf_config.config_from_hf, dict(llada, clip_qkv=8.0))
  _refused('partial_rotary', hf_config.config_from_hf, dict(llada, partial_rotary_factor=0.5))


def llada_moe_reference(sd, hf, ids, *, renormalise=False):
  """LLaDA-MoE's forward (module docstring) in float64 from its state dict; renormalise=True is
  the wrong router a broken import would compute (Qwen3-MoE's norm_topk_prob)."""
  sd = {k: v.double() for k, v in sd.items()}
  heads, kv, eps = hf['num_attention_heads'], hf['num_key_value_heads'], hf['rms_norm_eps']
  hd, top_k = hf['hidden_size'] // heads, hf['num_experts_per_tok']
  rms, rope = references.rms, references.rope
  x = sd['model.embed_tokens.weight'][torch.as_tensor(ids)]
  batch, length, _ = x.shape

  def swiglu(h, p):
    gate, up = h @ sd[p + 'gate_proj.weight'].T, h @ sd[p + 'up_proj.weight'].T
    return (torch.nn.functional.silu(gate) * up) @ sd[p + 'down_proj.weight'].T

  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    n = rms(x, sd[p + 'input_layernorm.weight'], eps)
    q = (n @ sd[p + 'self_attn.q_proj.weight'].T).view(batch, length, heads, hd)
    k = (n @ sd[p + 'self_attn.k_proj.weight'].T).view(batch, length, kv, hd)
    v = (n @ sd[p + 'self_attn.v_proj.weight'].T).view(batch, length, kv, hd)
    q = rms(q, sd[p + 'self_attn.q_norm.weight'], eps).transpose(1, 2)
    k = rms(k, sd[p + 'self_attn.k_norm.weight'], eps).transpose(1, 2)
    q, k = rope(q, hf['rope_theta']), rope(k, hf['rope_theta'])
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v.transpose(1, 2)))
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v  # no mask
    x = x + att.transpose(1, 2).reshape(batch, length, -1) @ sd[p + 'self_attn.o_proj.weight'].T
    h = rms(x, sd[p + 'post_attention_layernorm.weight'], eps)
    probs = torch.softmax(h @ sd[p + 'mlp.gate.weight'].T, -1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalise:
      weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(hf['num_experts']):
      w_e = (weights * (chosen == e)).sum(-1, keepdim=True)
      out = out + w_e * swiglu(h, p + f'mlp.experts.{e}.')
    if hf['shared_expert_intermediate_size']:
      out = out + swiglu(h, p + 'shared_expert.')
    x = x + out
  x = rms(x, sd['model.norm.weight'], eps)
  return (x @ sd['lm_head.weight'].T).numpy()


def test_llada_moe_imports_to_its_forward_and_exports_back_bit_exact(tmp_path):
  hf_dir, hf, sd = family_dirs.llada_moe_dir(tmp_path / 'llada_moe')
  theirs = llada_moe_reference(sd, hf, TOKENS)
  config, params = hf_io.load_hf(hf_dir)
  m = config.model
  e = m.moe
  assert (e.num_experts, e.experts_per_token, e.ffn_dim, e.shared_experts) == (4, 2, 32, 2)
  assert (e.router, m.qk_norm, m.head_dim, m.mask_token_id, m.rope_theta) == (
    'softmax_topk_raw',
    True,
    16,
    250,
    50000.0,
  )
  ours = _ours(config, params)
  _close(theirs, ours)
  with pytest.raises(AssertionError):
    _close(llada_moe_reference(sd, hf, TOKENS, renormalise=True), ours)

  out = str(tmp_path / 'export')
  hf_io.write_hf(out, config, params, dtype='fp32', trim_vocab=True, source_family='llada_moe')
  exported = _tensors(out)
  expected = {n: t.numpy() for n, t in sd.items() if not n.endswith('expert_bias')}
  assert sorted(exported) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(tensor, exported[name], err_msg=name)
  os.remove(os.path.join(out, hf_config.DLMJAX_CONFIG_FILE))
  assert hf_io.load_hf(out)[0].model == config.model


def test_llada_moe_nonzero_expert_bias_is_refused_in_one_line(tmp_path):
  hf_dir, _, sd = family_dirs.llada_moe_dir(tmp_path / 'llada_moe')
  sd['model.layers.1.mlp.expert_bias'][0] = 0.5
  config = hf_io.hf_dir_config(hf_dir)[1]
  _refused(
    'expert_bias is non-zero',
    hf_mapping.import_params,
    hf_mapping.DictSource(sd, to_numpy=lambda t: t.numpy()),
    'llada_moe',
    model_lib.ModelConfig.from_config(config),
    vocab_size=256,
  )


_ARCHITECTURE_KEYS = (
  'num_layers',
  'd_model',
  'num_heads',
  'num_kv_heads',
  'head_dim',
  'ffn_dim',
  'num_experts',
  'experts_per_token',
  'moe_ffn_dim',
  'shared_experts',
  'router',
  'vocab_size',
  'rope_theta',
  'norm_eps',
  'qk_norm',
  'qkv_bias',
  'tie_embeddings',
)


def _preset_architecture(name):
  return {k: model_lib.PRESETS[name][k] for k in _ARCHITECTURE_KEYS}


def test_published_moe_configs_import_as_their_presets():
  """Qwen/Qwen3-30B-A3B's config.json values and LLaDA-MoE-7B-A1B's (docs:
  families_and_decoding.md; no mask_token_id in it: the model card's 156895 is taken) give the
  presets' models."""
  qwen = dict(
    architectures=['Qwen3MoeForCausalLM'],
    model_type='qwen3_moe',
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    hidden_act='silu',
    bos_token_id=151643,
    eos_token_id=151643,
  )
  config = hf_config.config_from_hf(qwen)
  assert {
    k: config_lib.model_field(config.model, k) for k in _ARCHITECTURE_KEYS
  } == _preset_architecture('qwen3_30b_a3b')
  llada = {
    k: v
    for k, v in dict(
      family_dirs.LLADA_MOE_CONFIG,
      vocab_size=157184,
      hidden_size=2048,
      num_hidden_layers=16,
      num_attention_heads=16,
      num_key_value_heads=16,
      dense_intermediate_size=8192,
      expert_intermediate_size=1024,
      num_experts=64,
      num_experts_per_tok=8,
      shared_expert_intermediate_size=None,
      moe_layer_freq=[1] * 16,
      max_position_embeddings=8192,
      eos_token_id=156892,
      pad_token_id=156892,
    ).items()
    if k != 'mask_token_id'
  }
  config = hf_config.config_from_hf(llada)
  assert {
    k: config_lib.model_field(config.model, k) for k in _ARCHITECTURE_KEYS
  } == _preset_architecture('llada_moe_7b_a1b')
  assert (config.model.mask_token_id, config.model.eos_token_id) == (156895, 156892)


def test_moe_cli_round_trip_and_dense_layouts_refused(qwen3_moe, tmp_path, capsys):
  """`convert from-hf` records the family, `to-hf` writes it back by default (source), and a
  dense layout, or the LLaDA-MoE one for a renormalising router, is refused in one line naming
  the one that can hold the model."""
  from dlmjax import convert  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import run_dir as run_dir_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import step_meta  # pylint: disable=import-outside-toplevel

  hf_dir = qwen3_moe[0]
  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  _, step_dir, _ = run_dir_lib.resolve_step_dir(run_dir)
  assert step_meta.read_meta(step_dir)['source']['family'] == 'qwen3_moe'
  out = tmp_path / 'hf'
  to_hf = ['to-hf', '--checkpoint-path', run_dir, '--dtype', 'fp32', '--trim-vocab']
  assert convert.main([*to_hf, '--output-dir', str(out)]) == 0
  assert sorted(_tensors(str(out))) == sorted(_tensors(hf_dir))
  capsys.readouterr()
  for layout, why in (('qwen3', 'has a dense MLP'), ('llada_moe', 'never renormalises')):
    target = tmp_path / layout
    assert convert.main([*to_hf, '--output-dir', str(target), '--layout', layout]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f'error: cannot export with --layout={layout}: ') and why in err, err
    assert err.endswith('use --layout=qwen3_moe.') and len(err.splitlines()) == 1
    assert not target.exists()
