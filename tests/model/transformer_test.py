"""The transformer: layers against numpy statements, parameter count, scan == unrolled, remat."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.model import layers

CFG = model_lib.ModelConfig(
  num_layers=2,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  ffn_dim=64,
  vocab_size=128,
  seq_len=16,
)


def test_rmsnorm_matches_formula():
  import flax.nnx as nnx  # pylint: disable=import-outside-toplevel

  norm = layers.RMSNorm(8, eps=1e-6, rngs=nnx.Rngs(0))
  norm.scale.value = jnp.arange(8, dtype=jnp.float32)
  x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
  expected = np.arange(8) * x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5)


def test_rope_rotate_half():
  x = np.random.default_rng(1).normal(size=(1, 5, 2, 8)).astype(np.float32)
  pos = np.arange(5)[None]
  inv = 1e4 ** (-np.arange(0, 8, 2) / 8)
  ang = pos[..., None] * inv
  cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None]
  rot = np.concatenate([-x[..., 4:], x[..., :4]], -1)
  np.testing.assert_allclose(
    layers.rotary_embedding(jnp.asarray(x), jnp.asarray(pos), 1e4),
    x * cos + rot * sin,
    rtol=1e-5,
    atol=1e-6,
  )


@pytest.mark.parametrize(
  'tie,qk_norm,qkv_bias', [(False, True, False), (True, True, False), (True, False, True)]
)
def test_param_count_matches_tree(tie, qk_norm, qkv_bias):
  cfg = dataclasses.replace(CFG, tie_embeddings=tie, qk_norm=qk_norm, qkv_bias=qkv_bias)
  _, shapes, axes = model_lib.abstract(cfg)
  assert sum(np.prod(s.shape) for s in jax.tree.leaves(shapes)) == cfg.num_params()
  assert ('lm_head' in shapes) is (not tie)
  attn = shapes['blocks']['attn']
  assert ('q_norm' in attn and 'k_norm' in attn) is qk_norm
  assert all((f'{n}_bias' in attn) is qkv_bias for n in 'qkv') and 'o_bias' not in attn
  if qkv_bias:
    assert attn['k_bias'].shape == (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
  axes_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  for s, a in zip(jax.tree.leaves(shapes), axes_leaves):
    assert len(s.shape) == len(a)


def test_1p7b_param_count():
  cfg = dataclasses.replace(
    CFG,
    num_layers=28,
    d_model=2048,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    ffn_dim=6144,
    vocab_size=50304,
    seq_len=2048,
  )
  assert cfg.num_params() == 1_732_895_744  # reference: MegaDLMs 1.7B with V padded to 50304
  assert abs(cfg.flops_per_token() - 1.119e10) / 1.119e10 < 1e-3


@pytest.mark.parametrize(
  'preset,published',
  [
    # Qwen2.5 model cards: 0.49B (0.36B non-embedding), 7.61B (6.53B non-embedding).
    ('qwen2p5_0p5b', 494_032_768),
    ('qwen2p5_7b', 7_615_616_512),
    # Dream-org/Dream-v0-Base-7B: 7.62B safetensors (Qwen2.5-7B's shape, untied), 6.53B
    # non-embedding.
    ('dream_7b', 7_615_616_512),
  ],
)
def test_qwen2p5_presets_have_the_published_param_counts(preset, published):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.defaults()
  model_lib.apply_preset(config.model, preset)
  cfg = model_lib.ModelConfig.from_config(config)
  assert cfg.vocab_size == config.model.vocab_size  # 151936 and 152064 are multiples of 128
  assert cfg.num_params() == published
  embed = cfg.vocab_size * cfg.d_model
  non_embedding = cfg.num_params() - embed * (1 if cfg.tie_embeddings else 2)
  assert round(non_embedding / 1e9, 2) == {'qwen2p5_0p5b': 0.36, 'qwen2p5_7b': 6.53}.get(
    preset, 6.53
  )


@pytest.mark.parametrize(
  'preset,published,non_embedding_b,qk_norm',
  [
    # Qwen3 model cards (Qwen/Qwen3-0.6B, -1.7B, -8B): 0.6B (0.44B non-embedding), 1.7B (1.4B),
    # 8.2B (6.95B); exact counts with the tied embedding counted once (the HF safetensors of
    # 0.6B / 1.7B also store the tied head: 751,632,384 / 2,031,739,904).
    ('qwen3_0p6b', 596_049_920, 0.44, True),
    ('qwen3_1p7b', 1_720_574_976, 1.41, True),
    ('qwen3_8b', 8_190_735_360, 6.95, True),
    # meta-llama/Meta-Llama-3-8B safetensors total: 8,030,261,248.
    ('llama3_8b', 8_030_261_248, 6.98, False),
    # GSAI-ML/LLaDA-8B-Base safetensors 8.02B; LLaDA paper (Nie et al. 2025), architecture table:
    # 8.02B total, 6.98B non-embedding (the same blocks as Llama-3-8B, MHA and a 12288 MLP).
    ('llada_8b', 8_015_581_184, 6.98, False),
    # JetAstra/SDAR SDAR-{4B,8B}-Chat model.safetensors.index.json total_size / 2 (bf16):
    # 8,822,848,512 B and 16,381,470,720 B. SDAR-1.7B: Qwen3-1.7B's dims untied (presets.py).
    ('sdar_1p7b', 2_031_739_904, 1.41, True),
    ('sdar_4b', 4_411_424_256, 3.63, True),
    ('sdar_8b', 8_190_735_360, 6.95, True),
  ],
)
def test_published_presets_have_the_published_param_counts(
  preset, published, non_embedding_b, qk_norm
):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.defaults()
  model_lib.apply_preset(config.model, preset)
  config_lib.validate(config)
  cfg = model_lib.ModelConfig.from_config(config)
  assert cfg.vocab_size == config.model.vocab_size  # 151936, 128256, 126464: multiples of 128
  assert (cfg.qk_norm, cfg.qkv_bias) == (qk_norm, False)
  assert cfg.num_params() == published
  embed = cfg.vocab_size * cfg.d_model
  non_embedding = cfg.num_params() - embed * (1 if cfg.tie_embeddings else 2)
  assert round(non_embedding / 1e9, 2) == non_embedding_b


def test_qwen3_1p7b_is_not_megadlms_1p7b():
  """Both are kept: MegaDLMs' 1.7B (MHA, GPT-NeoX vocab, untied) is another model than Qwen3's."""
  a, b = model_lib.PRESETS['1p7b'], model_lib.PRESETS['qwen3_1p7b']
  differ = {k for k in a if a[k] != b.get(k)}
  assert {'num_kv_heads', 'vocab_size', 'tie_embeddings', 'rope_theta'} <= differ


def test_qk_norm_off_is_plain_rope_and_biases_add():
  """qk_norm=False: q and k go straight to RoPE; qkv_bias: biases shift q, k and v by the value."""
  cfg = dataclasses.replace(CFG, qk_norm=False, qkv_bias=True)
  params = model_lib.init_params(cfg, jax.random.key(0))
  assert not np.any(params['blocks']['attn']['q_bias'])  # zero init (draws no random numbers)
  base = model_lib.init_params(CFG, jax.random.key(0))
  for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):  # same stream with and without biases
    np.testing.assert_array_equal(params['blocks']['attn'][name], base['blocks']['attn'][name])
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  plain = _logits(cfg, params, tokens)
  rng = np.random.default_rng(0)
  biased = jax.tree.map(lambda x: x, params)
  for name in ('q_bias', 'k_bias', 'v_bias'):
    shape = params['blocks']['attn'][name].shape
    biased['blocks']['attn'][name] = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    assert not np.allclose(_logits(cfg, biased, tokens), plain, atol=1e-4), name
    biased['blocks']['attn'][name] = params['blocks']['attn'][name]
  # The QK-norm is really gone: scaling q changes the logits (a per-head norm would cancel it).
  scaled = jax.tree.map(lambda x: x, params)
  scaled['blocks']['attn']['q_proj'] = 3.0 * params['blocks']['attn']['q_proj']
  assert not np.allclose(_logits(cfg, scaled, tokens), plain, atol=1e-4)
  normed = jax.tree.map(lambda x: x, base)
  normed['blocks']['attn']['q_proj'] = 3.0 * base['blocks']['attn']['q_proj']
  np.testing.assert_allclose(_logits(CFG, normed, tokens), _logits(CFG, base, tokens), atol=1e-4)


def test_pallas_norm_backend_without_qk_norm_is_plain_rope():
  """norm_backend=pallas: the stream norms take the kernel (interpret mode on CPU); without
  QK-norm there is no fused norm + RoPE, and the logits are the XLA model's."""
  cfg = dataclasses.replace(CFG, qk_norm=False, qkv_bias=True)
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  pallas = dataclasses.replace(cfg, norm_backend='pallas')
  np.testing.assert_allclose(
    _logits(pallas, params, tokens), _logits(cfg, params, tokens), rtol=1e-5, atol=1e-5
  )


def test_init_statistics():
  cfg = dataclasses.replace(
    CFG, num_layers=4, d_model=256, ffn_dim=512, num_heads=4, num_kv_heads=4, head_dim=64
  )
  params = model_lib.init_params(cfg, jax.random.key(0))
  assert abs(float(params['blocks']['attn']['q_proj'].std()) - 0.02) < 1e-3
  assert abs(float(params['blocks']['mlp']['down_proj'].std()) - 0.02 / np.sqrt(8)) < 3e-4
  np.testing.assert_array_equal(params['final_norm']['scale'], 1.0)


def _logits(cfg, params, tokens):
  return model_lib.merge(cfg, params)(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _logits_and_grads(cfg, params, tokens):
  """Logits and d(sum of logits)/d(params), compiled (eager dispatch of the grads took ~1 min)."""
  return _logits(cfg, params, tokens), jax.grad(lambda p: _logits(cfg, p, tokens).sum())(params)


@pytest.mark.parametrize(
  'remat', ['none', 'minimal', 'save_dots', 'save_dots_attention', 'save_activations', 'full']
)
def test_scan_unrolled_and_remat_agree(remat):
  params = model_lib.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  cfg = dataclasses.replace(CFG, remat=remat, scan_layers=remat != 'full')
  ref, g_ref = _logits_and_grads(CFG, params, tokens)  # compiled once for all four cases
  got, g = _logits_and_grads(cfg, params, tokens)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _saved(capsys, cfg, params, tokens):
  """The residuals the backward keeps, one description per line (jax's public printer)."""
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(
    lambda p: model_lib.merge(cfg, p).hidden(tokens).astype(jnp.float32).sum(), params
  )
  return capsys.readouterr().out.splitlines()


def test_remat_policies_keep_what_they_say(capsys):
  """Per layer: save_dots_attention adds the attention kernel's output and softmax stats,
  save_activations the five named activations; every weight is kept as its bf16 cast, made once
  outside the remat region, not as float32."""
  cfg = dataclasses.replace(CFG, dtype='bfloat16', attention_backend='pallas', scan_layers=False)
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  saved = {
    r: _saved(capsys, dataclasses.replace(cfg, remat=r), params, tokens)
    for r in ('save_dots', 'save_dots_attention', 'save_activations')
  }

  def kernel(lines):
    return [line for line in lines if 'output of pallas_call' in line]

  assert not kernel(saved['save_dots'])
  assert len(kernel(saved['save_dots_attention'])) == 2 * CFG.num_layers  # output + stats
  assert kernel(saved['save_dots_attention'])[0].startswith('bf16[2,16,4,8]')
  for name in ('attn_norm', 'query_rope', 'key_rope', 'attn_residual', 'mlp_norm', 'mlp_hidden'):
    tag = f"named '{name}'"
    assert sum(tag in line for line in saved['save_activations']) == CFG.num_layers, name
    assert not any(tag in line for line in saved['save_dots_attention'])
  weight_shapes = {
    f'[{",".join(map(str, v.shape[1:]))}]' for v in jax.tree.leaves(params['blocks'])
  }
  for lines in saved.values():
    kept = [line for line in lines if line.split(' ')[0][line.index('[') :] in weight_shapes]
    assert kept and all(line.startswith('bf16') for line in kept), kept


def test_unrolled_layers_assemble_the_stacked_gradient_in_one_concatenate():
  """Per-layer indexing would transpose to one zero-padded full-size array per layer."""
  cfg = dataclasses.replace(CFG, scan_layers=False, num_layers=3)
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  text = str(jax.make_jaxpr(jax.grad(lambda p: _logits(cfg, p, tokens).sum()))(params))
  assert ' pad[' not in text and 'concatenate' in text


def test_bidirectional_model_sees_the_future_causal_does_not():
  params = model_lib.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 128)
  changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 128)
  for kind, moves in (('bidirectional', True), ('causal', False)):
    cfg = dataclasses.replace(CFG, attention_mask=kind)
    delta = jnp.abs(_logits(cfg, params, tokens) - _logits(cfg, params, changed))[0, :10].max()
    assert (float(delta) > 1e-4) is moves, kind


def test_bfloat16_compute_stays_close():
  params = model_lib.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  ref = _logits(CFG, params, tokens)
  got = _logits(dataclasses.replace(CFG, dtype='bfloat16'), params, tokens)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, ref, atol=0.05)


def test_logits_in_the_compute_dtype_are_the_float32_logits_rounded():
  """A forward that only returns or ranks logits asks for them in bf16: the same head, rounded
  once (a head computed in bf16 before accumulating would be further off)."""
  cfg = dataclasses.replace(CFG, dtype='bfloat16')
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  forward = jax.jit(
    lambda p, t, dtype: model_lib.merge(cfg, p)(t, logits_dtype=dtype), static_argnums=2
  )
  wide, narrow = forward(params, tokens, jnp.float32), forward(params, tokens, jnp.bfloat16)
  assert narrow.dtype == jnp.bfloat16
  np.testing.assert_allclose(narrow.astype(np.float32), wide, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize('tie', [True, False])
def test_computed_params_give_the_same_logits(tie):
  """The sampler casts once (computed_params) what each forward would cast at use: bit-equal
  logits (an embedding cast to float16 instead fails this)."""
  cfg = dataclasses.replace(CFG, dtype='bfloat16', tie_embeddings=tie)
  params = model_lib.init_params(cfg, jax.random.key(0))
  gain = 1 + 0.37 * jax.random.normal(jax.random.key(2), params['final_norm']['scale'].shape)
  params['final_norm']['scale'] = gain
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  cast = model_lib.computed_params(cfg, params, fuse=False)
  assert cast['blocks']['attn']['q_proj'].dtype == jnp.bfloat16
  assert cast['embed_tokens'].dtype == jnp.bfloat16
  assert cast['final_norm']['scale'].dtype == jnp.float32
  forward = jax.jit(_logits, static_argnums=0)
  np.testing.assert_array_equal(forward(cfg, cast, tokens), forward(cfg, params, tokens))


@pytest.mark.parametrize(
  'options',
  [
    dict(),
    dict(scan_layers=False),
    dict(qk_norm=False, qkv_bias=True, lora_rank=2, lora_alpha=4.0, lora_targets=('q', 'v', 'up')),
    dict(
      num_experts=4, shared_experts=1, dense_layers=(0,), weight_quant='int8', rope_fraction=0.5
    ),
    dict(
      weight_quant='nf4',
      lora_rank=2,
      lora_alpha=4.0,
      lora_targets=('k', 'gate', 'o'),
      scan_layers=False,
    ),
  ],
  ids=['plain', 'unrolled', 'bias_lora', 'int8_moe_shared', 'nf4_lora_unrolled'],
)
def test_fused_projections_give_the_unfused_logits(options):
  """The inference layout (q / k / v and gate / up concatenated once, one matmul each) gives
  the three-and-two-matmul logits up to float32 rounding of another grouping, with biases,
  LoRA adapters on some parts (B non-zero), int8 and nf4 storage, partial RoPE, scanned and
  unrolled layers, and MoE layers (shared experts fused, routed ones kept) beside dense ones."""
  cfg = dataclasses.replace(CFG, **options)
  params = model_lib.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(
    lambda x: x + 0.05 if x.dtype == jnp.float32 else x, params
  )  # non-zero biases and adapters' B
  fused = model_lib.computed_params(cfg, params)
  runs = {key: moe_mlp for key, moe_mlp, *_ in cfg.layer_runs()}
  for key, moe_mlp in runs.items():
    attn, mlp = fused[key]['attn'], fused[key]['mlp']
    assert 'qkv_proj' in attn and 'q_proj' not in attn
    assert attn['qkv_proj'].shape[-2] == CFG.num_heads + 2 * CFG.num_kv_heads
    assert ('qkv_proj_bias' in attn) is cfg.qkv_bias
    dense = mlp['shared'] if moe_mlp else mlp
    assert 'gate_up_proj' in dense and 'gate_proj' not in dense
    if moe_mlp:  # the routed experts keep gate and up apart
      assert 'gate_proj' in mlp and 'up_proj' in mlp
  if cfg.weight_quant != 'none':
    assert any(k.startswith('qkv_proj_') and k.endswith('scale') for k in fused['blocks']['attn'])
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  forward = jax.jit(
    lambda p, fuse: model_lib.inference_module(cfg, p, fuse=fuse)(tokens), static_argnums=1
  )
  np.testing.assert_allclose(forward(params, True), forward(params, False), rtol=0, atol=1e-5)


def test_packed_documents_are_isolated_with_restarted_positions():
  """A document's hidden states do not depend on its neighbours or where it sits in the row."""
  from dlmjax.diffusion import masking  # pylint: disable=import-outside-toplevel

  params = model_lib.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 128, size=6), rng.integers(0, 128, size=10)
  segments = jnp.asarray([[1] * 6 + [2] * 10, [1] * 10 + [2] * 6])
  # Rows [a b] and [b a]; the stand-in embedding table holds position j's input in row j, so
  # its gradient is the gradient w.r.t. each input position.
  table = params['embed_tokens'][np.concatenate([a, b, b, a])]

  def hidden(table_TD):
    module = model_lib.merge(CFG, dict(params, embed_tokens=table_TD))
    out = module.hidden(
      jnp.arange(32).reshape(2, 16),
      segment_ids_BL=segments,
      positions_BL=masking.segment_positions(segments),
    )
    return out[0, 2].sum(), out  # an output inside document a of row 0

  (_, out), grad = jax.jit(jax.value_and_grad(hidden, has_aux=True))(table)
  np.testing.assert_allclose(out[0, 6:], out[1, :10], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[0, :6], out[1, 10:], rtol=1e-5, atol=1e-5)
  grad = np.asarray(grad)
  assert np.abs(grad[:6]).sum(axis=1).min() > 0
  np.testing.assert_array_equal(grad[6:], 0.0)  # document b and row 1


def _shift_right(logits_BLV):
  """Dream's generate: cat([logits[:, :1], logits[:, :-1]], 1)."""
  return np.concatenate([logits_BLV[:, :1], logits_BLV[:, :-1]], axis=1)


def test_shift_logits_reads_token_i_from_position_i_minus_1():
  """model.shift_logits is the unshifted model's logits moved right by one (position 0 and each
  packed document's first position keep their own); the weights are the same."""
  from dlmjax.diffusion import masking  # pylint: disable=import-outside-toplevel

  params = model_lib.init_params(CFG, jax.random.key(0))
  shifted = dataclasses.replace(CFG, shift_logits=True)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  plain = np.asarray(_logits(CFG, params, tokens))
  got = np.asarray(_logits(shifted, params, tokens))
  np.testing.assert_allclose(got, _shift_right(plain), rtol=1e-6, atol=1e-6)
  assert np.abs(got - plain).max() > 1e-3  # the shift is visible.
  segments = jnp.asarray([[1] * 6 + [2] * 10, [1] * 16])
  kwargs = dict(segment_ids_BL=segments, positions_BL=masking.segment_positions(segments))
  plain = np.asarray(model_lib.merge(CFG, params)(tokens, **kwargs))
  got = np.asarray(model_lib.merge(shifted, params)(tokens, **kwargs))
  want = _shift_right(plain)
  want[0, 6] = plain[0, 6]  # document 2 of row 0 starts at 6: its own prediction.
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
