"""Tiny random-weight model directories of each family, laid out as the family ships them, for
the import, verify and every-stage tests: transformers' own Qwen2 / Llama (save_pretrained),
LLaDA (model.transformer.* names in two shards, LLaDAConfig's fields), Dream / DiffuCoder
(DreamConfig's fields, DreamModel's names in two shards) and SDAR (SDARConfig's fields over
Qwen3's tensors). Every tensor is random, biases and norm gains included, so a dropped
bias or a mixed-up norm shows.
"""

import json
import os

import pytest

from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
safetensors_torch = pytest.importorskip('safetensors.torch')


def write_hf_dir(directory, hf: dict, sd: dict, *, first_shard: int | None = None) -> str:
  """The one writer of a Hugging Face directory from a config dict and a state dict: config.json,
  the tensors (one model.safetensors, or two shards split after `first_shard` tensors with
  model.safetensors.index.json, as sharded releases ship them) and a tokenizer.json."""
  os.makedirs(directory, exist_ok=True)
  names = list(sd)
  if first_shard is None:
    shards = {'model.safetensors': names}
  else:
    shards = {
      'model-00001-of-00002.safetensors': names[:first_shard],
      'model-00002-of-00002.safetensors': names[first_shard:],
    }
  for file, shard_names in shards.items():
    safetensors_torch.save_file(
      {n: sd[n].contiguous() for n in shard_names},
      os.path.join(directory, file),
      metadata={'format': 'pt'},
    )
  if first_shard is not None:
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
      json.dump(dict(metadata=dict(total_size=0), weight_map=weight_map), f)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(hf, f, indent=2)
  tiny_run.write_tokenizer(directory, hf['vocab_size'])
  return str(directory)


def save_random_model(directory, build, *, seed: int = 0, scale=lambda name: 2.0) -> str:
  """save_pretrained of the transformers model `build()` makes (under torch seed `seed`) with
  every tensor redrawn: transformers initialises biases to zero and gains to one. Norm gains
  are 1 + noise, biases noise, the rest scale(name) x noise; a 256-token tokenizer beside."""
  torch.manual_seed(seed)
  model = build()
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = 0.1 * torch.randn_like(p)
      p.copy_(1.0 + noise if 'norm' in name else noise if 'bias' in name else scale(name) * noise)
  model.save_pretrained(directory)
  tiny_run.write_tokenizer(directory, 256)
  return str(directory)


_DIMS = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=64,
  bos_token_id=5,
  eos_token_id=2,
  pad_token_id=1,
)
TRANSFORMERS_FAMILIES = {
  # Qwen2.5-style: q/k/v biases, tied, theta 1e6.
  'qwen2': (
    'Qwen2Config',
    'Qwen2ForCausalLM',
    dict(_DIMS, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True),
  ),
  # Llama-3-style without rope_scaling: no biases, untied, theta 5e5, eps 1e-5, explicit head_dim.
  'llama': (
    'LlamaConfig',
    'LlamaForCausalLM',
    dict(_DIMS, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=False, head_dim=16),
  ),
}


def transformers_dir(directory, family: str, **overrides) -> str:
  """save_pretrained of a tiny random-weight transformers model of the family (its config in
  TRANSFORMERS_FAMILIES with `overrides`): transformers initialises biases to zero and gains to
  one, so every tensor is redrawn."""
  config_name, class_name, kwargs = TRANSFORMERS_FAMILIES[family]
  config = getattr(transformers, config_name)(**{**kwargs, **overrides})
  return save_random_model(directory, lambda: getattr(transformers, class_name)(config))


# configuration_llada.py's ModelConfig fields as LLaDAConfig.save_pretrained writes them, with
# LLaDA-8B's values where they are not sizes (llama block, rms, silu, rope theta 5e5, eps 1e-5,
# untied, mask 126336 -> a tiny id here) and tiny sizes.
LLADA_CONFIG = dict(
  activation_type='silu',
  alibi=False,
  alibi_bias_max=8.0,
  architectures=['LLaDAModelLM'],
  attention_dropout=0.0,
  attention_layer_norm=False,
  attention_layer_norm_with_affine=True,
  auto_map={
    'AutoConfig': 'configuration_llada.LLaDAConfig',
    'AutoModelForCausalLM': 'modeling_llada.LLaDAModelLM',
    'AutoModel': 'modeling_llada.LLaDAModelLM',
  },
  bias_for_layer_norm=False,
  block_group_size=1,
  block_type='llama',
  d_model=64,
  embedding_dropout=0.0,
  embedding_size=256,
  eos_token_id=2,
  flash_attention=False,
  include_bias=False,
  include_qkv_bias=False,
  init_cutoff_factor=None,
  init_device='meta',
  init_fn='mitchell',
  init_std=0.02,
  input_emb_norm=False,
  layer_norm_type='rms',
  layer_norm_with_affine=True,
  mask_token_id=250,
  max_sequence_length=64,
  mlp_hidden_size=96,
  mlp_ratio=4,
  model_type='llada',
  multi_query_attention=None,
  n_heads=4,
  n_kv_heads=4,
  n_layers=2,
  pad_token_id=2,
  precision='amp_bf16',
  residual_dropout=0.0,
  rms_norm_eps=1e-5,
  rope=True,
  rope_full_precision=True,
  rope_theta=500000.0,
  scale_logits=False,
  transformers_version='4.46.3',
  use_cache=False,
  vocab_size=256,
  weight_tying=False,
)
LLADA_VARIANTS = {
  # LLaDA-8B's architecture: MHA, untied, vocab_size == embedding_size.
  'llada_8b_like': {},
  # What else LLaDA's code computes and we can: GQA, tied head, q/k/v biases, and an embedding
  # padded past the tokenizer (embedding_size > vocab_size, as LLaDA allows).
  'gqa_tied_qkv_bias_padded': dict(
    n_kv_heads=2, weight_tying=True, include_qkv_bias=True, vocab_size=200, mask_token_id=199
  ),
}


def llada_state_dict(hf: dict, seed: int = 0) -> dict:
  """LLaDAModelLM's state dict names and shapes (self.model = LLaDAModel: model.transformer.*),
  every tensor random (norm gains around one)."""
  g = torch.Generator().manual_seed(seed)
  d, heads, layers = hf['d_model'], hf['n_heads'], hf['n_layers']
  hd, kv, f = d // heads, hf['n_kv_heads'], hf['mlp_hidden_size']
  rows = hf['embedding_size'] or hf['vocab_size']

  def rand(*shape, scale=0.2):
    return scale * torch.randn(*shape, generator=g)

  sd = {'model.transformer.wte.weight': rand(rows, d, scale=1.0)}
  for i in range(layers):
    p = f'model.transformer.blocks.{i}.'
    sd[p + 'attn_norm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'ff_norm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'q_proj.weight'] = rand(heads * hd, d)
    sd[p + 'k_proj.weight'] = rand(kv * hd, d)
    sd[p + 'v_proj.weight'] = rand(kv * hd, d)
    if hf['include_qkv_bias']:
      sd[p + 'q_proj.bias'] = rand(heads * hd)
      sd[p + 'k_proj.bias'] = rand(kv * hd)
      sd[p + 'v_proj.bias'] = rand(kv * hd)
    sd[p + 'attn_out.weight'] = rand(d, d)
    sd[p + 'ff_proj.weight'] = rand(f, d)
    sd[p + 'up_proj.weight'] = rand(f, d)
    sd[p + 'ff_out.weight'] = rand(d, f)
  sd['model.transformer.ln_f.weight'] = 1.0 + rand(d, scale=0.1)
  if not hf['weight_tying']:  # tied: LLaDAModel creates no transformer.ff_out.
    sd['model.transformer.ff_out.weight'] = rand(rows, d)
  return sd


def llada_dir(directory, variant: str):
  """A LLaDA model directory as save_pretrained writes it: config.json, two safetensors shards
  with model.safetensors.index.json (LLaDA-8B ships 6 shards), and a tokenizer.json."""
  hf = dict(LLADA_CONFIG, **LLADA_VARIANTS[variant])
  sd = llada_state_dict(hf)
  return write_hf_dir(directory, hf, sd, first_shard=7), hf, sd


SDAR_BLOCK = 4
# SDAR-8B-Chat's config.json (JetAstra/SDAR training/model/SDAR-8B-Chat) with tiny sizes; the
# training-only fields stay, as the released files carry them. mask 151669 -> a tiny id.
SDAR_CONFIG = dict(
  architectures=['SDARForCausalLM'],
  auto_map={
    'AutoConfig': 'configuration_sdar.SDARConfig',
    'AutoModel': 'modeling_sdar.SDARModel',
    'AutoModelForCausalLM': 'modeling_sdar.SDARForCausalLM',
  },
  attention_bias=False,
  attention_dropout=0.0,
  attn_implementation='flex_attention',
  bos_token_id=2,
  debug=False,
  eos_token_id=2,
  block_size=SDAR_BLOCK,
  mask_token_id=250,
  ep_size=1,
  fuse_cross_entropy=True,
  head_dim=16,
  hidden_act='silu',
  hidden_size=64,
  initializer_range=0.02,
  intermediate_size=128,
  max_position_embeddings=64,
  max_window_layers=2,
  micro_forward=False,
  model_type='sdar',
  num_attention_heads=4,
  num_hidden_layers=2,
  num_key_value_heads=2,
  rms_norm_eps=1e-06,
  rope_scaling=None,
  rope_theta=1000000,
  skip_checkpoint=False,
  sliding_window=None,
  tie_word_embeddings=False,
  torch_dtype='float32',
  transformers_version='4.52.4',
  use_cache=False,
  use_deepep=False,
  use_sliding_window=False,
  vocab_size=256,
)


def sdar_dir(directory, *, seed=0, tied=False) -> str:
  """An SDAR-*-Chat-style directory: random Qwen3-named tensors (norm gains around one), SDAR's
  config.json and a tokenizer. Returns it; `reference_logits` computes SDAR's forward of it."""
  os.makedirs(directory, exist_ok=True)
  hf = dict(SDAR_CONFIG, tie_word_embeddings=tied)
  config = transformers.Qwen3Config(
    **{k: hf[k] for k in ('vocab_size', 'hidden_size', 'intermediate_size', 'head_dim')},
    num_hidden_layers=hf['num_hidden_layers'],
    num_attention_heads=hf['num_attention_heads'],
    num_key_value_heads=hf['num_key_value_heads'],
    max_position_embeddings=hf['max_position_embeddings'],
    rms_norm_eps=hf['rms_norm_eps'],
    rope_theta=float(hf['rope_theta']),
    tie_word_embeddings=tied,
  )
  save_random_model(directory, lambda: transformers.Qwen3ForCausalLM(config), seed=seed)
  with open(os.path.join(directory, 'config.json'), 'w') as f:  # SDAR's fields over Qwen3's
    json.dump(hf, f, indent=2)
  return str(directory)


# DreamConfig's fields as Dream-v0-Base-7B's config.json has them (Qwen2.5-7B's values where they
# are not sizes: theta 1e6, eps 1e-6, untied, 131072 positions, no sliding window), tiny sizes
# and a tiny <|mask|> id.
DREAM_CONFIG = dict(
  architectures=['DreamModel'],
  attention_dropout=0.0,
  auto_map={
    'AutoConfig': 'configuration_dream.DreamConfig',
    'AutoModel': 'modeling_dream.DreamModel',
  },
  bos_token_id=2,
  eos_token_id=2,
  hidden_act='silu',
  hidden_size=64,
  initializer_range=0.02,
  intermediate_size=96,
  mask_token_id=250,
  max_position_embeddings=131072,
  max_window_layers=2,
  model_type='Dream',
  num_attention_heads=4,
  num_hidden_layers=2,
  num_key_value_heads=2,
  pad_token_id=2,
  rms_norm_eps=1e-6,
  rope_scaling=None,
  rope_theta=1000000.0,
  sliding_window=131072,
  tie_word_embeddings=False,
  torch_dtype='bfloat16',
  transformers_version='4.46.2',
  use_cache=False,
  use_sliding_window=False,
  vocab_size=256,
)


def dream_state_dict(hf: dict, seed: int = 0) -> dict:
  """DreamModel's state dict names and shapes (model = DreamBaseModel), every tensor random: the
  q/k/v biases non-zero, norm gains around one."""
  g = torch.Generator().manual_seed(seed)
  d, heads, kv = hf['hidden_size'], hf['num_attention_heads'], hf['num_key_value_heads']
  hd, f, rows = d // heads, hf['intermediate_size'], hf['vocab_size']

  def rand(*shape, scale=0.2):
    return scale * torch.randn(*shape, generator=g)

  sd = {'model.embed_tokens.weight': rand(rows, d, scale=1.0)}
  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    sd[p + 'input_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'post_attention_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    for name, out in (('q_proj', heads * hd), ('k_proj', kv * hd), ('v_proj', kv * hd)):
      sd[p + f'self_attn.{name}.weight'] = rand(out, d)
      sd[p + f'self_attn.{name}.bias'] = rand(out, scale=0.5)
    sd[p + 'self_attn.o_proj.weight'] = rand(d, heads * hd)
    sd[p + 'mlp.gate_proj.weight'] = rand(f, d)
    sd[p + 'mlp.up_proj.weight'] = rand(f, d)
    sd[p + 'mlp.down_proj.weight'] = rand(d, f)
  sd['model.norm.weight'] = 1.0 + rand(d, scale=0.1)
  if not hf['tie_word_embeddings']:
    sd['lm_head.weight'] = rand(rows, d)
  return sd


def dream_dir(directory, **changes):
  """A Dream directory as save_pretrained writes it: config.json, two safetensors shards with
  model.safetensors.index.json (Dream-v0-7B ships 4), and a tokenizer.json."""
  hf = dict(DREAM_CONFIG, **changes)
  sd = dream_state_dict(hf)
  return write_hf_dir(directory, hf, sd, first_shard=9), hf, sd


# Mixture-of-experts families (docs/moe.md). transformers' Qwen3MoeConfig with tiny sizes: 4
# experts of width 32, top-2 renormalised (Qwen3-30B-A3B's norm_topk_prob), every layer sparse.
QWEN3_MOE_CONFIG = dict(
  _DIMS,
  intermediate_size=96,
  moe_intermediate_size=32,
  num_experts=4,
  num_experts_per_tok=2,
  norm_topk_prob=True,
  head_dim=16,
  rms_norm_eps=1e-6,
  rope_theta=1e6,
  tie_word_embeddings=False,
)


def qwen3_moe_dir(directory, **overrides) -> str:
  """save_pretrained of a tiny random-weight Qwen3MoeForCausalLM (QWEN3_MOE_CONFIG with
  `overrides`): per-expert names on disk, as the published checkpoints have them. The router
  is redrawn larger so its top-k differs clearly between tokens."""
  config = transformers.Qwen3MoeConfig(**{**QWEN3_MOE_CONFIG, **overrides})
  return save_random_model(
    directory,
    lambda: transformers.Qwen3MoeForCausalLM(config),
    scale=lambda name: 20.0 if 'mlp.gate' in name else 2.0,
  )


# LLaDAMoEConfig's fields (dllm's configuration_lladamoe.py) with LLaDA-MoE-7B-A1B's values where
# they are not sizes (theta 5e4, eps 1e-5, QK-norm, softmax router, untied; model_type 'llada' and
# LLaDAMoEModelLM as the release names them), tiny sizes, a shared expert of two experts' width
# (the release has none; modeling_lladamoe.py adds it to every token) and a tiny mask id.
LLADA_MOE_CONFIG = dict(
  architectures=['LLaDAMoEModelLM'],
  model_type='llada',
  vocab_size=256,
  hidden_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  hidden_act='silu',
  max_position_embeddings=64,
  initializer_range=0.02,
  rms_norm_eps=1e-5,
  use_cache=False,
  tie_word_embeddings=False,
  attention_dropout=0.0,
  attention_bias=False,
  clip_qkv=None,
  dense_intermediate_size=128,
  expert_intermediate_size=32,
  num_experts=4,
  num_experts_per_tok=2,
  shared_expert_intermediate_size=64,
  moe_layer_freq=[1, 1],
  qk_layernorm=True,
  moe_router_score_function='softmax',
  moe_router_enable_expert_bias=True,
  output_router_logits=False,
  router_aux_loss_coef=0.01,
  norm_topk_prob=None,
  rope_theta=50000.0,
  rope_scaling=None,
  partial_rotary_factor=1.0,
  eos_token_id=2,
  pad_token_id=2,
  mask_token_id=250,
)


def llada_moe_state_dict(hf: dict, seed: int = 0) -> dict:
  """LLaDAMoEModelLM's state dict names and shapes (model = LLaDAMoEModel, OLMoE's layer:
  self_attn with per-head q/k norms, mlp.gate and mlp.experts.{e}, the layer's shared_expert,
  the expert_bias buffer, zero here), every weight random (norm gains around one)."""
  g = torch.Generator().manual_seed(seed)
  d, heads, kv = hf['hidden_size'], hf['num_attention_heads'], hf['num_key_value_heads']
  hd, f, experts = d // heads, hf['expert_intermediate_size'], hf['num_experts']
  shared = hf['shared_expert_intermediate_size']

  def rand(*shape, scale=0.2):
    return scale * torch.randn(*shape, generator=g)

  sd = {'model.embed_tokens.weight': rand(hf['vocab_size'], d, scale=1.0)}
  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    sd[p + 'input_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'post_attention_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    for name, out in (('q_proj', heads * hd), ('k_proj', kv * hd), ('v_proj', kv * hd)):
      sd[p + f'self_attn.{name}.weight'] = rand(out, d)
    sd[p + 'self_attn.o_proj.weight'] = rand(d, d)
    sd[p + 'self_attn.q_norm.weight'] = 1.0 + rand(hd, scale=0.1)
    sd[p + 'self_attn.k_norm.weight'] = 1.0 + rand(hd, scale=0.1)
    sd[p + 'mlp.gate.weight'] = rand(experts, d, scale=2.0)
    if hf['moe_router_enable_expert_bias']:
      sd[p + 'mlp.expert_bias'] = torch.zeros(experts)
    for e in range(experts):
      sd[p + f'mlp.experts.{e}.gate_proj.weight'] = rand(f, d)
      sd[p + f'mlp.experts.{e}.up_proj.weight'] = rand(f, d)
      sd[p + f'mlp.experts.{e}.down_proj.weight'] = rand(d, f)
    if shared:
      sd[p + 'shared_expert.gate_proj.weight'] = rand(shared, d)
      sd[p + 'shared_expert.up_proj.weight'] = rand(shared, d)
      sd[p + 'shared_expert.down_proj.weight'] = rand(d, shared)
  sd['model.norm.weight'] = 1.0 + rand(d, scale=0.1)
  sd['lm_head.weight'] = rand(hf['vocab_size'], d)
  return sd


def llada_moe_dir(directory, **changes):
  """A LLaDA-MoE directory: config.json, one model.safetensors, a tokenizer.json. Returns
  (directory, config dict, state dict)."""
  hf = dict(LLADA_MOE_CONFIG, **changes)
  sd = llada_moe_state_dict(hf)
  return write_hf_dir(directory, hf, sd), hf, sd


# LLaDA2MoeConfig's fields as dFactory's llada2_mini config.json has them, tiny sizes, every
# option on: q/k/v bias (use_qkv_bias), QK-norm, RoPE on half of each head, layer 0 dense
# (first_k_dense_replace), 8 experts in 4 groups of which a token keeps 2, top-2, weights x 2.5,
# one shared expert; use_bias off (zero attention.dense.bias is accepted, tested apart); theta 1e4
# so that RoPE turns visibly over 16 tokens; block_size 4 so that the block-causal mask shows.
LLADA2_CONFIG = dict(
  architectures=['LLaDA2MoeModelLM'],
  model_type='llada2_moe',
  vocab_size=256,
  hidden_size=64,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  intermediate_size=96,
  moe_intermediate_size=16,
  first_k_dense_replace=1,
  hidden_act='silu',
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
  use_qkv_bias=True,
  use_bias=False,
  norm_head=False,
  tie_word_embeddings=False,
  rope_theta=10000.0,
  rope_scaling=None,
  partial_rotary_factor=0.5,
  rotary_dim=8,
  num_experts=8,
  num_experts_per_tok=2,
  num_shared_experts=1,
  n_group=4,
  topk_group=2,
  routed_scaling_factor=2.5,
  score_function='sigmoid',
  moe_router_enable_expert_bias=True,
  norm_topk_prob=True,
  router_dtype='fp32',
  use_sliding_window=False,
  block_size=4,
  pad_token_id=2,
  eos_token_id=2,
  mask_token_id=250,
)
# The same family with every option the other way: no q/k/v bias, no QK-norm (SGLang's
# use_qk_norm=false: no query/key_layernorm tensors), RoPE on every dim, no dense layer, one group
# (plain top-k), no routed scaling, no shared expert.
LLADA2_OPTIONS_OFF = dict(
  use_qkv_bias=False,
  use_qk_norm=False,
  partial_rotary_factor=1.0,
  rotary_dim=16,
  first_k_dense_replace=0,
  n_group=1,
  topk_group=1,
  routed_scaling_factor=1.0,
  num_shared_experts=None,
)


def llada2_state_dict(hf: dict, seed: int = 0) -> dict:
  """LLaDA2MoeModelLM's state dict names and shapes (the per-expert ModuleList of model_type
  llada2_moe), every tensor random: the expert bias and the router large enough that groups,
  bias and top-k change which experts tokens take."""
  g = torch.Generator().manual_seed(seed)
  d, heads, kv, hd = (
    hf[k] for k in ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim')
  )
  experts, f, dense_f = hf['num_experts'], hf['moe_intermediate_size'], hf['intermediate_size']
  shared = (hf.get('num_shared_experts') or 0) * f

  def rand(*shape, scale=0.2):
    return scale * torch.randn(*shape, generator=g)

  def mlp(prefix, width):
    return {
      prefix + 'gate_proj.weight': rand(width, d),
      prefix + 'up_proj.weight': rand(width, d),
      prefix + 'down_proj.weight': rand(d, width),
    }

  sd = {'model.word_embeddings.weight': rand(hf['vocab_size'], d, scale=1.0)}
  for i in range(hf['num_hidden_layers']):
    p = f'model.layers.{i}.'
    sd[p + 'input_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'post_attention_layernorm.weight'] = 1.0 + rand(d, scale=0.1)
    sd[p + 'attention.query_key_value.weight'] = rand((heads + 2 * kv) * hd, d)
    if hf['use_qkv_bias']:
      sd[p + 'attention.query_key_value.bias'] = rand((heads + 2 * kv) * hd, scale=0.5)
    if hf.get('use_qk_norm', True):
      sd[p + 'attention.query_layernorm.weight'] = 1.0 + rand(hd, scale=0.1)
      sd[p + 'attention.key_layernorm.weight'] = 1.0 + rand(hd, scale=0.1)
    sd[p + 'attention.dense.weight'] = rand(d, heads * hd)
    if i < hf['first_k_dense_replace']:
      sd.update(mlp(p + 'mlp.', dense_f))
      continue
    sd[p + 'mlp.gate.weight'] = rand(experts, d, scale=2.0)
    sd[p + 'mlp.gate.expert_bias'] = rand(experts, scale=0.5)
    for e in range(experts):
      sd.update(mlp(p + f'mlp.experts.{e}.', f))
    if shared:
      sd.update(mlp(p + 'mlp.shared_experts.', shared))
  sd['model.norm.weight'] = 1.0 + rand(d, scale=0.1)
  sd['lm_head.weight'] = rand(hf['vocab_size'], d)
  return sd


def llada2_dir(directory, **changes):
  """A LLaDA2 directory: config.json, one model.safetensors, a tokenizer.json. Returns
  (directory, config dict, state dict)."""
  hf = dict(LLADA2_CONFIG, **changes)
  sd = llada2_state_dict(hf)
  return write_hf_dir(directory, hf, sd), hf, sd
