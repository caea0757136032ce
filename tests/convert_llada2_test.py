"""LLaDA2.x in and out (checkpoint/families/llada2_moe.py).

A tiny directory laid out as modeling_llada2_moe.py's LLaDA2MoeModelLM names it imports into a
model whose logits are a float64 forward written here from that file's formulas
(`llada2_reference`): the fused query_key_value (q | k | v rows, its bias), q/k RMSNorm per head,
rotate-half RoPE on the first int(head_dim x partial_rotary_factor) dims with that width's
frequencies, the block-causal mask of dFactory's generate, layer 0 dense, the sigmoid gate in
float32 choosing top-k of score + expert_bias among the topk_group best of n_group groups (a group
scores its two best), weights the unbiased scores renormalised times routed_scaling_factor, and
the shared expert. Every option is on in one directory and off in the other; each mutation of the
reference (an option computed the other way) must fail the comparison.
"""

import json
import math
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import convert
from dlmjax import model as model_lib
from dlmjax import verify
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hf_layouts
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import safetensors_io
from tests.checkpoint import family_dirs

torch = pytest.importorskip('torch')

TOKENS = np.random.default_rng(2).integers(0, 256, (2, 16))
MUTATIONS = ('full_rope', 'ungrouped', 'unscaled', 'unbiased', 'no_shared', 'no_qkv_bias')


def _rms(x, w, eps):
  return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x_BNLH, theta, rope_dim):
  """apply_rotary_pos_emb: rotate-half on x[..., :rope_dim], frequencies of a rope_dim head."""
  length = x_BNLH.shape[-2]
  inv = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
  angles = torch.arange(length, dtype=torch.float64)[:, None] * inv
  cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
  rot, rest = x_BNLH[..., :rope_dim], x_BNLH[..., rope_dim:]
  half = rope_dim // 2
  rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
  return torch.cat([rot * cos + rotated * sin, rest], -1)


def llada2_reference(sd, hf, ids, *, mutation=None):
  """LLaDA2's forward (module docstring) in float64; `mutation` computes one option the other
  way (MUTATIONS), as a broken import would."""
  sd = {k: v.double() for k, v in sd.items()}
  heads, kv, hd = hf['num_attention_heads'], hf['num_key_value_heads'], hf['head_dim']
  eps, experts, top_k = hf['rms_norm_eps'], hf['num_experts'], hf['num_experts_per_tok']
  groups = 1 if mutation == 'ungrouped' else hf['n_group']
  rope_dim = hd if mutation == 'full_rope' else int(hd * hf['partial_rotary_factor'])
  scale = 1.0 if mutation == 'unscaled' else hf['routed_scaling_factor']
  x = sd['model.word_embeddings.weight'][torch.as_tensor(ids)]
  batch, length, _ = x.shape
  block = torch.arange(length) // hf['block_size']
  additive = torch.zeros(length, length, dtype=torch.float64)
  additive[block[:, None] < block[None, :]] = -math.inf  # tril over blocks, as generate builds it

  def swiglu(h, p):
    gate, up = h @ sd[p + 'gate_proj.weight'].T, h @ sd[p + 'up_proj.weight'].T
    return (torch.nn.functional.silu(gate) * up) @ sd[p + 'down_proj.weight'].T

  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    n = _rms(x, sd[p + 'input_layernorm.weight'], eps)
    qkv = n @ sd[p + 'attention.query_key_value.weight'].T
    if p + 'attention.query_key_value.bias' in sd and mutation != 'no_qkv_bias':
      qkv = qkv + sd[p + 'attention.query_key_value.bias']
    q, k, v = qkv.view(batch, length, heads + 2 * kv, hd).split([heads, kv, kv], dim=2)
    if p + 'attention.query_layernorm.weight' in sd:
      q = _rms(q, sd[p + 'attention.query_layernorm.weight'], eps)
      k = _rms(k, sd[p + 'attention.key_layernorm.weight'], eps)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = _rope(q, hf['rope_theta'], rope_dim), _rope(k, hf['rope_theta'], rope_dim)
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + additive, -1) @ v
    x = x + att.transpose(1, 2).reshape(batch, length, -1) @ sd[p + 'attention.dense.weight'].T
    h = _rms(x, sd[p + 'post_attention_layernorm.weight'], eps)
    if i < hf['first_k_dense_replace']:
      x = x + swiglu(h, p + 'mlp.')
      continue
    scores = torch.sigmoid(h @ sd[p + 'mlp.gate.weight'].T)
    routing = scores if mutation == 'unbiased' else scores + sd[p + 'mlp.gate.expert_bias']
    grouped = routing.view(batch, length, groups, -1)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
    kept = torch.zeros_like(group_scores).scatter_(
      -1, group_scores.topk(1 if groups == 1 else hf['topk_group'], dim=-1)[1], 1.0
    )
    masked = grouped.masked_fill(kept[..., None] == 0, -math.inf).view(batch, length, experts)
    chosen = masked.topk(top_k, dim=-1)[1]
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale
    out = torch.zeros_like(h)
    for e in range(experts):
      out = out + (weights * (chosen == e)).sum(-1, keepdim=True) * swiglu(
        h, p + f'mlp.experts.{e}.'
      )
    if p + 'mlp.shared_experts.gate_proj.weight' in sd and mutation != 'no_shared':
      out = out + swiglu(h, p + 'mlp.shared_experts.')
    x = x + out
  x = _rms(x, sd['model.norm.weight'], eps)
  return (x @ sd['lm_head.weight'].T).numpy()


def _close(theirs, ours):
  assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(theirs).max())


def _tensors(hf_dir):
  reader = safetensors_io.SafetensorsReader(hf_dir)
  return {name: np.asarray(reader.get(name)) for name in reader.keys()}


def _ours(config, params):
  cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(cfg, params)(TOKENS))


@pytest.fixture(scope='module', params=['on', 'off'])
def llada2(request, tmp_path_factory):
  """(directory, config.json, state dict, our imported config and params, our logits) with every
  option on, or every one off."""
  changes = {} if request.param == 'on' else family_dirs.LLADA2_OPTIONS_OFF
  hf_dir, hf, sd = family_dirs.llada2_dir(tmp_path_factory.mktemp('llada2'), **changes)
  config, params = hf_io.load_hf(hf_dir)
  return request.param, hf_dir, hf, sd, config, params, _ours(config, params)


def test_llada2_imports_to_its_forward_and_each_option_can_fail(llada2):
  options, _, hf, sd, config, params, ours = llada2
  m, e = config.model, config.model.moe
  on = options == 'on'
  assert (e.router, e.num_experts, e.experts_per_token, e.ffn_dim) == ('sigmoid_bias', 8, 2, 16)
  assert (e.router_groups, e.router_group_topk, e.routed_scale) == (
    (4, 2, 2.5) if on else (1, 1, 1.0)
  )
  assert (m.rope_fraction, e.dense_layers, e.shared_experts) == (
    (0.5, '0', 1) if on else (1.0, '', 0)
  )
  assert (m.qkv_bias, m.qk_norm) == (on, on)
  assert (m.attention_mask, m.block_size, m.mask_token_id) == ('block_causal', 4, 250)
  _close(llada2_reference(sd, hf, TOKENS), ours)
  for mutation in MUTATIONS if on else ('unbiased',):
    with pytest.raises(AssertionError):
      _close(llada2_reference(sd, hf, TOKENS, mutation=mutation), ours)
  _check_fused_experts_import(hf, sd, config, params)


def test_llada2_cli_round_trip_is_bit_exact(llada2, tmp_path, capsys):
  """`convert from-hf` records the family; `to-hf` writes it back by default and with
  --layout llada2_moe, every tensor bit for bit, and the export re-imports to the same model."""
  _, hf_dir, _, sd, config, _, _ = llada2
  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  to_hf = ['to-hf', '--checkpoint-path', run_dir, '--dtype', 'fp32', '--trim-vocab']
  for layout in ('source', 'llada2_moe'):
    out = str(tmp_path / layout)
    assert convert.main([*to_hf, '--output-dir', out, '--layout', layout]) == 0
    exported = _tensors(out)
    assert sorted(exported) == sorted(sd)
    for name, tensor in sd.items():
      np.testing.assert_array_equal(tensor.numpy(), exported[name], err_msg=name)
  with open(os.path.join(out, 'config.json')) as f:
    written = json.load(f)
  assert (written['model_type'], written['architectures']) == ('llada2_moe', ['LLaDA2MoeModelLM'])
  os.remove(os.path.join(out, hf_config.DLMJAX_CONFIG_FILE))
  assert hf_io.load_hf(out)[0].model == config.model
  # verify --hf-dir: the source's tensors, by LLaDA2's names, equal the run's export.
  checks = {c.name: c for c in verify.verify(run_dir, hf_dir=hf_dir)}
  assert all(c.ok for c in checks.values()), verify.report(list(checks.values()))
  assert 'exported weights' in checks and 'skipped' in checks['logits parity'].detail
  capsys.readouterr()


def _check_fused_experts_import(hf, sd, config, params):
  """dFactory's training form (model_type llada2_moe_veomni: mlp.experts.gate_proj [E, I, H],
  down_proj [E, H, I]) reads to the per-expert form's params."""
  fused = {n: t for n, t in sd.items() if '.experts.' not in n}
  for i in range(hf['first_k_dense_replace'], hf['num_hidden_layers']):
    p = f'model.layers.{i}.mlp.experts.'
    for k in ('gate', 'up', 'down'):
      fused[f'{p}{k}_proj'] = torch.stack([sd[f'{p}{e}.{k}_proj.weight'] for e in range(8)])
  cfg = model_lib.ModelConfig.from_config(config)
  source = hf_mapping.DictSource(fused, to_numpy=lambda t: t.numpy())
  back = hf_mapping.import_params(source, 'llada2_moe', cfg, vocab_size=256)
  moe = 'blocks_1' if hf['first_k_dense_replace'] else 'blocks'
  for key in ('gate_proj', 'up_proj', 'down_proj', 'router_bias'):
    np.testing.assert_array_equal(back[moe]['mlp'][key], params[moe]['mlp'][key])


def _refused(match, fn, *args, **kwargs):
  with pytest.raises(ValueError, match=match) as e:
    fn(*args, **kwargs)
  assert '\n' not in str(e.value)


def test_what_llada2_dlmjax_cannot_compute_is_refused_in_one_line(tmp_path):
  hf = family_dirs.LLADA2_CONFIG
  for change, named in (
    (dict(norm_topk_prob=False), 'norm_topk_prob=false'),
    (dict(norm_head=True), 'norm_head=true'),
    (dict(score_function='softmax'), "score_function='softmax'"),
    (dict(num_experts_per_tok=1), 'num_experts_per_tok=1'),
    (dict(n_group=3), 'n_group=3'),
    (dict(rope_scaling=dict(rope_type='yarn', factor=2.0)), "'yarn'"),
  ):
    _refused(named, hf_config.config_from_hf, dict(hf, **change))
  # use_bias: attention.dense.bias imports only when zero.
  hf_dir, _, sd = family_dirs.llada2_dir(tmp_path / 'biased', use_bias=True)
  cfg = model_lib.ModelConfig.from_config(hf_io.hf_dir_config(hf_dir)[1])
  source = dict(sd, **{'model.layers.0.attention.dense.bias': torch.zeros(64)})
  hf_mapping.import_params(
    hf_mapping.DictSource(source, lambda t: t.numpy()), 'llada2_moe', cfg, vocab_size=256
  )
  source['model.layers.0.attention.dense.bias'][3] = 0.5
  _refused(
    'dense.bias is non-zero',
    hf_mapping.import_params,
    hf_mapping.DictSource(source, lambda t: t.numpy()),
    'llada2_moe',
    cfg,
    vocab_size=256,
  )
  # A softmax-routed model has no expert bias for this layout; a sigmoid one none in the others.
  qwen_moe = hf_config.config_from_hf(dict(family_dirs.QWEN3_MOE_CONFIG, model_type='qwen3_moe'))
  _refused('use --layout=qwen3_moe', hf_layouts.choose, 'llada2_moe', _model_config(qwen_moe))
  ours = hf_config.config_from_hf(hf)
  _refused('use --layout=llada2_moe', hf_layouts.choose, 'llada_moe', _model_config(ours))


def _model_config(config):
  return model_lib.ModelConfig.from_config(config)


def test_router_group_keys_are_checked_in_one_line():
  config = config_lib.defaults()
  model_lib.apply_preset(config.model, 'tiny_moe')
  for changes, named in (
    (dict(router_groups=3), 'router_groups=3 must divide'),
    (dict(router_groups=2), 'limits the sigmoid_bias router only'),
    (
      dict(router='sigmoid_bias', router_groups=4, router_group_topk=1, experts_per_token=3),
      'exceeds',
    ),
    (dict(rope_fraction=0.3), 'rope_fraction=0.3'),
  ):
    bad = config_lib.from_dict(config.to_dict())
    config_lib.set_model_fields(bad.model, changes)
    _refused(named, config_lib.validate, bad)


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
  'router_groups',
  'router_group_topk',
  'routed_scale',
  'dense_layers',
  'rope_fraction',
  'vocab_size',
  'rope_theta',
  'norm_eps',
  'qk_norm',
  'qkv_bias',
  'tie_embeddings',
  'attention_mask',
  'block_size',
  'mask_token_id',
  'eos_token_id',
  'pad_token_id',
)


@pytest.mark.parametrize(
  'preset, layers, hidden, heads, dense, expert',
  [
    ('llada2_mini', 20, 2048, 16, 5120, 512),
    ('llada2_flash', 32, 4096, 32, 9216, 1024),
  ],
)
def test_published_llada2_configs_import_as_their_presets(
  preset, layers, hidden, heads, dense, expert
):
  """dFactory's configs/model_configs/llada2_{mini,flash}/config.json values give the presets."""
  published = dict(
    architectures=['LLaDA2MoeModelLM'],
    model_type='llada2_moe_veomni',
    num_hidden_layers=layers,
    hidden_size=hidden,
    intermediate_size=dense,
    first_k_dense_replace=1,
    hidden_act='silu',
    max_position_embeddings=16384,
    moe_intermediate_size=expert,
    norm_topk_prob=True,
    num_experts_per_tok=8,
    norm_head=False,
    num_attention_heads=heads,
    num_experts=256,
    num_key_value_heads=4,
    rope_theta=600000,
    rope_scaling=None,
    tie_word_embeddings=False,
    use_bias=False,
    rms_norm_eps=1e-06,
    head_dim=128,
    num_shared_experts=1,
    use_qkv_bias=False,
    vocab_size=157184,
    rotary_dim=64,
    moe_router_enable_expert_bias=True,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    score_function='sigmoid',
    pad_token_id=156892,
    partial_rotary_factor=0.5,
    use_sliding_window=False,
  )
  config = hf_config.config_from_hf(published)
  want = model_lib.PRESETS[preset]
  assert {k: config_lib.model_field(config.model, k) for k in _ARCHITECTURE_KEYS} == {
    k: want[k] for k in _ARCHITECTURE_KEYS
  }
