"""Dream in and out exactly: a tiny random-weight Dream directory, laid out as Dream-org/Dream-v0-*
and apple/DiffuCoder-7B-* ship it (config.json of DreamConfig's fields, model_type 'Dream',
DreamModel; sharded safetensors named model.layers.*), imported through `convert from-hf`,
`hf_io.load_hf`, `load_pretrained`, `init_from` and checked by `verify --hf-dir`, gives the logits
of a plain PyTorch forward written here from Dream's published formulas; exported back to Dream's
layout it is the same tensors bit for bit.

The reference follows modeling_dream.py (read, not copied; no transformers):
  x = embed_tokens[ids]; per layer: x += o_proj(attn(rope(q_proj(n)), rope(k_proj(n)),
  v_proj(n))) with n = RMSNorm(x) * input_layernorm.weight and q/k/v_proj carrying biases, o_proj
  none; x += down_proj(silu(gate_proj(m)) * up_proj(m)) with m = RMSNorm(x) *
  post_attention_layernorm.weight; h = RMSNorm(x) * norm.weight; l = h @ lm_head.T.
  RMSNorm: x * rsqrt(mean(x^2) + rms_norm_eps). Head size H = hidden_size / num_attention_heads.
  RoPE: rotate-half, inv_freq = theta^(-arange(0, H, 2) / H). Attention: softmax(q k^T / sqrt(H)),
  no mask (DreamAttention: is_causal=False), k/v heads repeat_interleave'd (GQA). The prediction
  for token i is l[i-1], position 0's its own (generation_utils.py: cat([l[:, :1], l[:, :-1]])).
"""

import json
import math
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import convert
from dlmjax import inference
from dlmjax import model as model_lib
from dlmjax import verify
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint.families import dream
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from dlmjax.data import tokenizer as tokenizer_lib
from tests.checkpoint import family_dirs
from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
safetensors_torch = pytest.importorskip('safetensors.torch')

DREAM_CONFIG = family_dirs.DREAM_CONFIG
dream_dir = family_dirs.dream_dir


def _rms(x, w, eps):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(t_BNTH, theta):
  hd, length = t_BNTH.shape[-1], t_BNTH.shape[-2]
  inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
  angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
  angles = torch.cat((angles, angles), -1)
  x1, x2 = t_BNTH[..., : hd // 2], t_BNTH[..., hd // 2 :]
  return t_BNTH * angles.cos() + torch.cat((-x2, x1), -1) * angles.sin()


def dream_reference(sd, hf, ids, *, swap_gate_up=False, drop_bias=False, unshift=False):
  """Dream's forward and logit shift (module docstring) in float64 from its state dict; the
  flags are the wrong details a broken import would compute instead."""
  sd = {k: v.double() for k, v in sd.items()}
  heads, kv, eps = hf['num_attention_heads'], hf['num_key_value_heads'], hf['rms_norm_eps']
  hd = hf['hidden_size'] // heads
  x = sd['model.embed_tokens.weight'][torch.as_tensor(ids)]
  batch, length, _ = x.shape

  def linear(h, name):
    out = h @ sd[name + '.weight'].T
    bias = sd.get(name + '.bias')
    return out if bias is None or drop_bias else out + bias

  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    n = _rms(x, sd[p + 'input_layernorm.weight'], eps)
    q = linear(n, p + 'self_attn.q_proj').view(batch, length, heads, hd).transpose(1, 2)
    k = linear(n, p + 'self_attn.k_proj').view(batch, length, kv, hd).transpose(1, 2)
    v = linear(n, p + 'self_attn.v_proj').view(batch, length, kv, hd).transpose(1, 2)
    q, k = _rope(q, hf['rope_theta']), _rope(k, hf['rope_theta'])
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v  # no mask
    x = x + linear(att.transpose(1, 2).reshape(batch, length, -1), p + 'self_attn.o_proj')
    m = _rms(x, sd[p + 'post_attention_layernorm.weight'], eps)
    gate, up = linear(m, p + 'mlp.gate_proj'), linear(m, p + 'mlp.up_proj')
    if swap_gate_up:
      gate, up = up, gate
    x = x + linear(torch.nn.functional.silu(gate) * up, p + 'mlp.down_proj')
  x = _rms(x, sd['model.norm.weight'], eps)
  head = sd['model.embed_tokens.weight' if hf['tie_word_embeddings'] else 'lm_head.weight']
  logits = x @ head.T
  if not unshift:
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
  return logits.numpy()


def _ours(config, params, tokens):
  cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(cfg, params)(tokens))


def _close(theirs, ours):
  """<= 1e-4 relative to the logits' scale (fp32 ours against the float64 reference)."""
  assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(theirs).max())


def _restored(run_dir):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(run_dir)
  config = run_dir_lib.load_run_config(run_dir)
  return config, params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))


@pytest.mark.parametrize('changes', [{}, dict(tie_word_embeddings=True)], ids=['untied', 'tied'])
def test_dream_directory_imports_to_dream_function(tmp_path, changes):
  hf_dir, hf, sd = dream_dir(tmp_path / 'dream', **changes)
  tokens = np.random.default_rng(1).integers(0, hf['vocab_size'], (2, 24))
  theirs = dream_reference(sd, hf, tokens)

  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  config, params = _restored(run_dir)
  m = config.model
  assert (m.qk_norm, m.qkv_bias, m.shift_logits, m.attention_mask) == (
    False,
    True,
    True,
    'bidirectional',
  )
  assert m.tie_embeddings == hf['tie_word_embeddings']
  assert (m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_dim) == (4, 2, 16, 96)
  assert (m.rope_theta, m.norm_eps, m.seq_len) == (1e6, 1e-6, dream.TRAINED_LENGTH)
  assert (m.vocab_size, m.mask_token_id, m.eos_token_id, m.pad_token_id) == (256, 250, 2, 2)
  step_dir = run_dir_lib.resolve_step_dir(run_dir)[1]
  assert step_meta.read_meta(step_dir)['source']['family'] == 'dream'
  _close(theirs, _ours(config, params, tokens))

  _, params = hf_io.load_hf(hf_dir)
  _close(theirs, _ours(config, params, tokens))
  pretrained = inference.load_pretrained(hf_dir)
  _close(theirs, _ours(pretrained.config, pretrained.params, tokens))
  # verify --hf-dir: the directory's tensors are our export's, and its PyTorch forward (Reference,
  # shifted as Dream reads it) gives our logits.
  checks = verify.verify(run_dir, hf_dir=hf_dir)
  assert all(c.ok for c in checks), verify.report(checks)


@pytest.mark.parametrize('wrong', ['swap_gate_up', 'drop_bias', 'unshift'], ids=lambda w: w)
def test_the_parity_sees_a_wrong_detail(tmp_path, wrong):
  """The comparison above can fail: Dream with gate/up swapped, its q/k/v biases dropped, or its
  logits left unshifted is far past the tolerance from what the import computes."""
  hf_dir, hf, sd = dream_dir(tmp_path / 'dream')
  tokens = np.random.default_rng(1).integers(0, hf['vocab_size'], (2, 24))
  config, params = hf_io.load_hf(hf_dir)
  ours = _ours(config, params, tokens)
  _close(dream_reference(sd, hf, tokens), ours)
  with pytest.raises(AssertionError):
    _close(dream_reference(sd, hf, tokens, **{wrong: True}), ours)


def test_export_to_dream_layout_round_trips_bit_exact(tmp_path):
  """A Dream import exports back as Dream (names, config.json fields Dream's code reads); the
  tensors are the source's bit for bit, and the export re-imports to the same params."""
  hf_dir, hf, sd = dream_dir(tmp_path / 'dream')
  config, params = hf_io.load_hf(hf_dir)
  out = hf_io.write_hf(str(tmp_path / 'out'), config, params, dtype='fp32', trim_vocab=True)
  with open(os.path.join(out, 'config.json')) as f:
    exported = json.load(f)
  assert (exported['model_type'], exported['architectures']) == ('Dream', ['DreamModel'])
  assert exported['auto_map'] == {
    'AutoConfig': f'{dream.CODE_REPO}--configuration_dream.DreamConfig',
    'AutoModel': f'{dream.CODE_REPO}--modeling_dream.DreamModel',
  }
  for key in (
    'hidden_size',
    'intermediate_size',
    'num_hidden_layers',
    'num_attention_heads',
    'num_key_value_heads',
    'vocab_size',
    'rope_theta',
    'rms_norm_eps',
    'tie_word_embeddings',
    'mask_token_id',
    'pad_token_id',
    'eos_token_id',
    'hidden_act',
    'use_sliding_window',
  ):
    assert exported[key] == hf[key], key
  assert 'head_dim' not in exported  # DreamAttention derives it from hidden_size.
  reader = safetensors_io.SafetensorsReader(out)
  assert sorted(reader.keys()) == sorted(sd)
  for name, tensor in sd.items():
    np.testing.assert_array_equal(reader.get(name), tensor.numpy(), err_msg=name)
  again_config, again = hf_io.load_hf(out)
  assert again_config.model.shift_logits
  tiny_run.assert_same_params(params, again)


@pytest.mark.parametrize(
  'change, named',
  [
    (dict(qk_norm=True), 'has no QK-norm'),
    (dict(qkv_bias=False), 'q/k/v biases'),
    (dict(head_dim=8), 'num_heads \\* head_dim == d_model'),
    (dict(attention_mask='causal'), 'attends bidirectionally'),
  ],
)
def test_models_dream_cannot_hold_are_refused_by_name(change, named):
  config = hf_config.config_from_hf(DREAM_CONFIG)
  config.model.update(change)
  with pytest.raises(hf_config.HFConfigError, match=named):
    dream.write(config, vocab_rows=256, dtype='fp32')


def test_shifted_models_export_only_as_dream():
  """No other family reads token i from position i-1: a shifted model exports as Dream or not at
  all, and Dream's layout refuses an unshifted model (it would compute another function)."""
  assert hf_config.export_family(qk_norm=False, qkv_bias=True, shift_logits=True) == 'dream'
  with pytest.raises(hf_config.HFConfigError, match='shift_logits=True exports only as Dream'):
    hf_config.export_family(qk_norm=True, qkv_bias=False, shift_logits=True)
  config = hf_config.config_from_hf(DREAM_CONFIG)
  config.model.shift_logits = False
  with pytest.raises(hf_config.HFConfigError, match='reads token i from position i-1'):
    dream.write(config, vocab_rows=256, dtype='fp32')


def test_absent_dream_fields_mean_dream_defaults():
  """DreamConfig fills absent fields: <|mask|> 151666 and <|endoftext|> 151643 padding."""
  hf = dict(DREAM_CONFIG, vocab_size=152064)
  for key in ('mask_token_id', 'pad_token_id', 'rope_theta', 'tie_word_embeddings'):
    del hf[key]
  config = hf_config.config_from_hf(hf)
  m = config.model
  assert (m.mask_token_id, m.pad_token_id, m.rope_theta, m.tie_embeddings) == (
    151666,
    151643,
    10000.0,
    False,
  )


def test_dream_7b_config_imports_as_the_dream_7b_preset():
  """Dream-v0-Base-7B's config.json sizes and ids read into exactly the preset."""
  hf = dict(
    DREAM_CONFIG,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_window_layers=28,
    vocab_size=152064,
    mask_token_id=151666,
    bos_token_id=151643,
    eos_token_id=151643,
    pad_token_id=151643,
  )
  config = hf_config.config_from_hf(hf)
  preset = model_lib.PRESETS['dream_7b']
  assert {k: config.model[k] for k in preset} == preset


def test_init_from_a_dream_directory_adopts_its_model(tmp_path):
  from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel

  hf_dir, _, _ = dream_dir(tmp_path / 'dream')
  config = config_lib.defaults()  # every model key at its default: all come from Dream's
  config.init_from = hf_dir
  changed = set(init_from.adopt_source_config(config))
  assert {'model.shift_logits=True', 'model.qkv_bias=True', 'model.qk_norm=False'} <= changed
  assert {'model.ffn_dim=96', 'model.vocab_size=256', 'model.rope_theta=1000000.0'} <= changed
  _, params = hf_io.load_hf(hf_dir, config=config)  # what init_from restores: checked, exact
  tiny_run.assert_same_params(hf_io.load_hf(hf_dir)[1], params)
  config.model.shift_logits = False  # a config that says otherwise is refused by name.
  with pytest.raises(hf_config.HFConfigError, match='model.shift_logits: checkpoint True'):
    hf_io.load_hf(hf_dir, config=config)


def test_completions_end_before_diffucoders_padding_piece(tmp_path, monkeypatch):
  """DiffuCoder's generate keeps the text before the first <|dlm_pad|> (apple/ml-diffucoder
  README); `generate` cuts the completion's ids there, wherever the tokenizer puts the piece."""
  import tokenizers  # pylint: disable=import-outside-toplevel

  # Id 7 is the piece alone (not the id DiffuCoder's tokenizer gives it): a second word on one id
  # is dropped at random when tokenizers saves the vocabulary.
  vocab = {f't{i}': i for i in range(10) if i != 7}
  vocab[inference.DIFFUCODER_PAD_PIECE] = 7
  tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='t0')).save(
    str(tmp_path / 'tokenizer.json')
  )
  config = config_lib.defaults()
  model = inference.Pretrained(config, params={})
  model.tokenizer = tokenizer_lib.load_tokenizer(
    str(tmp_path / 'tokenizer.json'), eod_token=0, require_mask=False
  )
  rows = [[1, 2, 7, 3, 7], [4, 5], [7, 6]]
  monkeypatch.setattr(model, 'generate_tokens', lambda ids, **kwargs: rows)
  texts = model.generate(['t1', 't2', 't3'], chat_template='none')
  assert texts == [model.tokenizer.decode([1, 2]), model.tokenizer.decode([4, 5]), '']
