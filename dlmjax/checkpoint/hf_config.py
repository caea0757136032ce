"""Hugging Face config.json <-> dlmjax config: which architecture a checkpoint is, and its dims.

Exports (the layouts of hf_layouts) write a transformers family's config.json (to_hf: by default
the one whose layout holds the model exactly, export_family: Qwen3 with QK-norm, Qwen2 with q/k/v
biases, Llama with neither) plus MegaDLMs DiffLM's `mask_token_id` and `attn_mask_type`, so
`Qwen3ForCausalLM` / `Qwen2ForCausalLM` / `LlamaForCausalLM` load them and DiffLM tooling finds
its fields, or LLaDA's (llada_to_hf), Dream's for a shifted model (dream_to_hf) or SDAR's for a
block-causal QK-norm one (sdar_to_hf). Imports read
Qwen3, MegaDLMs DiffLM, Qwen2, Llama, LLaDA, SDAR and Dream configs, each into the model options of
its family (model.qk_norm, model.qkv_bias, model.rope_scaling, model.shift_logits, SDAR's
block-causal attention), and the MoE families Qwen3-MoE and LLaDA-MoE (qwen3_moe_to_hf and
llada_moe_to_hf write them: model.moe.num_experts, model.moe.router, ...); anything else, or a
part we cannot compute (sliding windows, a RoPE scaling type without a formula here, dense layers
among MoE ones), is refused by name.
"""

from __future__ import annotations

import json
import os

from dlmjax import config as config_lib

DLMJAX_CONFIG_FILE = 'dlmjax_config.json'  # the full run config, beside config.json in exports.
ARCHITECTURES = (
  'qwen3',
  'difflm',
  'qwen2',
  'llama',
  'llada',
  'sdar',
  'dream',
  'qwen3_moe',
  'llada_moe',
)
_MASK_KINDS = ('bidirectional', 'causal', 'block_causal')
# Exported families: (model.qk_norm, model.qkv_bias) -> the transformers class computing it.
EXPORT_FAMILIES = {(True, False): 'qwen3', (False, True): 'qwen2', (False, False): 'llama'}
_HF_CLASSES = dict(qwen3='Qwen3ForCausalLM', qwen2='Qwen2ForCausalLM', llama='LlamaForCausalLM')


class HFConfigError(ValueError):
  """A Hugging Face config we cannot represent; the message says what differs and what to do."""


def read(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise HFConfigError(f'{path} is missing: {hf_dir} is not a Hugging Face model directory.')
  with open(path) as f:
    return json.load(f)


def detect_architecture(hf: dict) -> str:
  """One of ARCHITECTURES, from `architectures` and `model_type`."""
  names = [a.lower() for a in hf.get('architectures') or []]
  model_type = str(hf.get('model_type', '')).lower()
  if any('difflm' in n for n in names):
    return 'difflm'  # MegaDLMs' HF class; its config has no model_type.
  # LLaDA-MoE's released config.json keeps the dense model's model_type 'llada' (docs:
  # families_and_decoding.md, LLaDA-MoE); its classes LLaDAMoEModel / LLaDAMoEModelLM tell it
  # apart, as dllm's model_type 'lladamoe' and configuration_lladamoe.py's 'llada_moe' do.
  if model_type in ('lladamoe', 'llada_moe') or any(n.startswith('lladamoe') for n in names):
    return 'llada_moe'
  if model_type == 'qwen3_moe' or any(n.startswith('qwen3moe') for n in names):
    return 'qwen3_moe'
  if model_type == 'llada' or any('llada' in n for n in names):
    return 'llada'
  if model_type.startswith('sdar') or any(n.startswith('sdar') for n in names):
    return _sdar_architecture(hf, model_type, names)
  if model_type == 'dream' or any(n.startswith('dream') for n in names):
    return 'dream'  # Dream-v0-*, Dream-Coder, DiffuCoder: model_type 'Dream', DreamModel.
  for arch in ('qwen3', 'qwen2', 'llama'):
    if model_type == arch or any(n.startswith(arch) for n in names):
      return arch
  raise HFConfigError(
    f'unknown architecture (model_type={model_type!r}, architectures='
    f'{hf.get("architectures")}); dlmjax reads {", ".join(ARCHITECTURES)}.'
  )


# SDAR / TraDo (JetAstra/SDAR training/model/SDAR-*-Chat: configuration_sdar.py, modeling_sdar.py)
# are Qwen3 exactly (Qwen3's tensor names, RMSNorm on q and k per head before rotate-half RoPE,
# SwiGLU, no biases) trained and decoded with block-causal attention: a query in block a sees the
# keys of blocks <= a, bidirectionally inside its own (modeling_sdar.py's block_diff_mask on the
# clean stream; generate.py's inference mask). Logits score their own position (no shift).
SDAR_DEFAULT_BLOCK_SIZE = 4  # SDAR README: the released models' default; b8..b64 variants set it.
# The Hub's SDAR-*-Chat config.json (JetLM/SDAR-4B-Chat) carries no mask_token_id: SDAR's
# generate.py reads it from the tokenizer's mask_token <|MASK|>, id 151669 (tokenizer_config.json),
# the id its README passes to JetEngine. An import without the field takes it.
SDAR_MASK_TOKEN_ID = 151669


def _sdar_architecture(hf: dict, model_type: str, names: list[str]) -> str:
  if 'moe' in model_type or any('moe' in n for n in names) or hf.get('num_experts'):
    raise HFConfigError(
      f'SDAR mixture-of-experts (model_type={model_type!r}, e.g. SDAR-30B-A3B) is not supported: '
      "dlmjax's MLP is dense; the dense SDAR-1.7B/4B/8B and TraDo-4B/8B import."
    )
  return 'sdar'


def _sdar_mask(hf: dict) -> dict:
  """The attention an SDAR checkpoint computes: block-causal over its config's block_size."""
  return dict(
    attention_mask='block_causal',
    block_size=int(hf.get('block_size') or SDAR_DEFAULT_BLOCK_SIZE),
  )


def _rope(hf: dict) -> dict:
  """model.rope_theta and model.rope_scaling from transformers v5 `rope_parameters` or the older
  `rope_theta` / `rope_scaling`; a scaling type without a formula here is refused by name."""
  params = hf.get('rope_parameters') or {}
  scaling = hf.get('rope_scaling') or {}
  kind = params.get('rope_type') or scaling.get('rope_type') or scaling.get('type') or 'default'
  theta = float(params.get('rope_theta', hf.get('rope_theta', 10000.0)))
  if kind == 'default':
    return dict(rope_theta=theta, rope_scaling='')
  fields = config_lib.ROPE_SCALING_FIELDS.get(kind)
  if fields is None:
    raise HFConfigError(
      f'rope_scaling type {kind!r} is not supported: dlmjax computes '
      f'{", ".join(config_lib.ROPE_SCALING_FIELDS)} (no yarn, dynamic, longrope, su scaling).'
    )
  source = {**scaling, **params}
  missing = [k for k in fields if k not in source]
  if missing:
    raise HFConfigError(f'rope_scaling type {kind!r} without {", ".join(missing)}.')
  if source.get('attention_factor') not in (None, 1, 1.0):
    raise HFConfigError(
      f'rope_scaling attention_factor={source["attention_factor"]}: dlmjax does not rescale '
      'the rotary tables.'
    )
  values = {k: float(source[k]) for k in fields}
  return dict(rope_theta=theta, rope_scaling=config_lib.format_rope_scaling(kind, values))


def _rope_fields(rope_scaling: str) -> dict:
  """The rope_type and fields a transformers config.json carries for model.rope_scaling."""
  parsed = config_lib.parse_rope_scaling(rope_scaling)
  if parsed is None:
    return dict(rope_type='default')
  kind, fields = parsed
  if 'original_max_position_embeddings' in fields:
    fields['original_max_position_embeddings'] = int(fields['original_max_position_embeddings'])
  return dict(rope_type=kind, **fields)


def _dims(hf: dict, arch: str) -> dict:
  """dlmjax model.* values a Hugging Face config determines."""
  if arch == 'llada':
    return _llada_dims(hf)
  if arch == 'dream':
    return _dream_dims(hf)
  if arch == 'llada_moe':
    return _llada_moe_dims(hf)
  if arch == 'qwen3_moe':
    return dict(_dims(hf, 'qwen3'), **_qwen3_moe_experts(hf))
  if hf.get('hidden_act', 'silu') != 'silu':
    raise HFConfigError(f"hidden_act={hf['hidden_act']!r}: dlmjax's MLP is SwiGLU (silu).")
  layer_types = hf.get('layer_types') or []
  if hf.get('use_sliding_window') or any(t != 'full_attention' for t in layer_types):
    raise HFConfigError(
      'sliding-window attention (use_sliding_window / sliding_attention layers) is not '
      'supported; dlmjax attends to the full sequence.'
    )
  if hf.get('mlp_bias'):
    raise HFConfigError("mlp_bias=true: dlmjax's MLP has no biases.")
  if arch != 'qwen2' and hf.get('attention_bias'):
    raise HFConfigError(
      f"attention_bias=true: {arch}'s o_proj then has a bias too, which dlmjax's attention lacks."
    )
  heads = hf['num_attention_heads']
  dims = dict(
    num_layers=hf['num_hidden_layers'],
    d_model=hf['hidden_size'],
    num_heads=heads,
    num_kv_heads=hf.get('num_key_value_heads') or heads,
    head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
    ffn_dim=hf['intermediate_size'],
    vocab_size=hf['vocab_size'],
    **_rope(hf),
    norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
    tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
    qk_norm=has_qk_norm(arch),
    qkv_bias=arch in ('qwen2', 'dream'),  # Qwen2Attention, DreamAttention: q/k/v bias=True.
  )
  if 'max_position_embeddings' in hf:
    dims['seq_len'] = hf['max_position_embeddings']
  return dims


# DreamConfig's defaults for the fields the import reads (configuration_dream.py), so an absent
# key means what Dream means; the special ids are Dream's <|mask|> and <|endoftext|>.
_DREAM_DEFAULTS = dict(
  rope_theta=10000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  mask_token_id=151666,
  pad_token_id=151643,
)
# Dream-v0 was trained on 2048-token sequences (DreamLM/Dream README); its config's
# max_position_embeddings (131072) is Qwen2.5's, so an import's canvas is capped at this.
DREAM_TRAINED_LENGTH = 2048


def _dream_dims(hf: dict) -> dict:
  """Dream's config (Qwen2's fields, model_type 'Dream') read as modeling_dream.py builds it:
  Qwen2's block (q/k/v biases, no o bias, no QK-norm, rotate-half RoPE), head size hidden_size /
  num_attention_heads (DreamAttention ignores any head_dim), attention hard-coded bidirectional,
  and the prediction for token i read from position i-1 (generation_utils.py's logit shift)."""
  hf = dict(_DREAM_DEFAULTS, **{k: v for k, v in hf.items() if v is not None})
  hf.pop('head_dim', None)
  dims = _dims(hf, 'qwen2')
  dims.update(
    shift_logits=True,
    attention_mask='bidirectional',
    seq_len=min(dims.get('seq_len', DREAM_TRAINED_LENGTH), DREAM_TRAINED_LENGTH),
  )
  return dims


def dream_special_ids(hf: dict) -> dict:
  """mask / eos / pad ids of a Dream config, DreamConfig's defaults where it has none."""
  return {
    k: hf.get(k, _DREAM_DEFAULTS.get(k)) for k in ('mask_token_id', 'eos_token_id', 'pad_token_id')
  }


# LLaDAConfig fills every field config.json leaves out from its ModelConfig defaults
# (configuration_llada.py); the ones the import reads, so an absent key means what LLaDA means.
_LLADA_DEFAULTS = dict(
  block_type='sequential',
  block_group_size=1,
  layer_norm_type='default',
  layer_norm_with_affine=True,
  bias_for_layer_norm=None,
  activation_type='swiglu',
  rope=False,
  alibi=False,
  input_emb_norm=False,
  scale_logits=False,
  attention_layer_norm=False,
  include_bias=False,
  include_qkv_bias=False,
  multi_query_attention=None,
  n_kv_heads=None,
  mlp_ratio=4,
  mlp_hidden_size=None,
  rope_theta=10000.0,
  rms_norm_eps=1e-5,
  weight_tying=True,
  embedding_size=50304,
  max_sequence_length=1024,
)


def _llada(hf: dict, key: str):
  return hf.get(key, _LLADA_DEFAULTS[key])


def _llada_dims(hf: dict) -> dict:
  """LLaDA's OLMo-style config (d_model, n_heads, ...) read as modeling_llada.py builds the model;
  only its `llama` block (pre-norm RMSNorm with a gain, silu(ff_proj) * up_proj, rotate-half RoPE,
  bidirectional attention) maps to ours, and anything else is refused by name."""
  for key, wanted in (
    ('block_type', 'llama'),
    ('block_group_size', 1),  # >1 nests the blocks under block_groups.{g}: another layout.
    ('layer_norm_type', 'rms'),
    ('layer_norm_with_affine', True),
    # LLaDALlamaBlock multiplies act(ff_proj(x)) by up_proj(x): with act=silu that is SwiGLU;
    # 'swiglu' would halve ff_proj's output first (a shape LLaDA itself cannot multiply).
    ('activation_type', 'silu'),
    ('rope', True),
    ('alibi', False),
    ('input_emb_norm', False),
    ('scale_logits', False),
    ('include_bias', False),
  ):
    if _llada(hf, key) != wanted:
      raise HFConfigError(
        f"LLaDA config {key}={_llada(hf, key)!r}: only {key}={wanted!r} maps onto dlmjax's "
        'transformer.'
      )
  if _llada(hf, 'bias_for_layer_norm'):
    raise HFConfigError("LLaDA bias_for_layer_norm=true: dlmjax's RMSNorm has no bias.")
  if _llada(hf, 'attention_layer_norm'):
    raise HFConfigError(
      'LLaDA attention_layer_norm=true normalises q and k over all heads at '
      'once (OLMo style); dlmjax normalises each head, so cannot represent it.'
    )
  heads = hf['n_heads']
  kv = _llada(hf, 'n_kv_heads')
  if kv is None:  # configuration_llada.py: effective_n_kv_heads.
    kv = 1 if _llada(hf, 'multi_query_attention') else heads
  ffn = _llada(hf, 'mlp_hidden_size') or _llada(hf, 'mlp_ratio') * hf['d_model']
  return dict(
    num_layers=hf['n_layers'],
    d_model=hf['d_model'],
    num_heads=heads,
    num_kv_heads=kv,
    head_dim=hf['d_model'] // heads,
    ffn_dim=ffn,
    vocab_size=hf['vocab_size'],
    rope_theta=float(_llada(hf, 'rope_theta')),
    rope_scaling='',  # LLaDA's RoPE has no scaling (modeling_llada.py RotaryEmbedding).
    norm_eps=float(_llada(hf, 'rms_norm_eps')),
    tie_embeddings=bool(_llada(hf, 'weight_tying')),
    seq_len=_llada(hf, 'max_sequence_length'),
    qk_norm=False,
    # include_qkv_bias: q/k/v_proj get biases (LLaDALlamaBlock), attn_out and the MLP do not.
    qkv_bias=bool(_llada(hf, 'include_qkv_bias')),
  )


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts families (docs/moe.md, Hugging Face checkpoints)


def _qwen3_moe_experts(hf: dict) -> dict:
  """The MoE options of a transformers Qwen3MoeConfig (configuration_qwen3_moe.py,
  modeling_qwen3_moe.py): softmax over the experts in float32, the top num_experts_per_tok,
  renormalised when norm_topk_prob; no shared expert. Layers listed in mlp_only_layers, or off the
  decoder_sparse_step grid ((i + 1) % step != 0), are dense Qwen3MoeMLPs of intermediate_size:
  model.moe.dense_layers, whose MLP is ffn_dim wide."""
  experts = hf.get('num_experts', hf.get('num_local_experts'))
  if not experts:
    raise HFConfigError('qwen3_moe config with num_experts=0 is a dense model; save it as Qwen3.')
  layers = int(hf['num_hidden_layers'])
  try:
    dense = config_lib.dense_layer_indices(
      layers,
      sparse_step=int(1 if hf.get('decoder_sparse_step') is None else hf['decoder_sparse_step']),
      mlp_only=[int(i) for i in hf.get('mlp_only_layers') or []],
    )
  except config_lib.ConfigError as e:
    raise HFConfigError(f'Qwen3-MoE config: {e}') from None
  if dense and len(dense.split(',')) == layers:
    raise HFConfigError(
      'this qwen3_moe config makes every layer dense (decoder_sparse_step / mlp_only_layers); '
      'save it as Qwen3.'
    )
  return dict(
    dense_layers=dense,
    num_experts=int(experts),
    experts_per_token=int(hf.get('num_experts_per_tok', 8)),
    moe_ffn_dim=int(hf['moe_intermediate_size']),
    shared_experts=0,
    router='softmax_topk' if hf.get('norm_topk_prob', False) else 'softmax_topk_raw',
  )


# LLaDAMoEConfig's defaults (dllm's configuration_lladamoe.py) for the fields the import reads, so
# an absent key means what LLaDA-MoE means.
_LLADA_MOE_DEFAULTS = dict(
  num_key_value_heads=16,
  hidden_act='silu',
  max_position_embeddings=8192,
  rms_norm_eps=1e-5,
  tie_word_embeddings=False,
  attention_bias=False,
  clip_qkv=None,
  dense_intermediate_size=8192,
  expert_intermediate_size=1024,
  num_experts=64,
  num_experts_per_tok=8,
  shared_expert_intermediate_size=None,
  moe_layer_freq=None,
  qk_layernorm=True,
  moe_router_score_function='softmax',
  moe_router_enable_expert_bias=False,
  rope_theta=50000.0,
  rope_scaling=None,
  partial_rotary_factor=1.0,
  eos_token_id=156892,
  pad_token_id=156892,
)
# The mask id LLaDA-MoE's model card and dInfer generate with (absent from its config.json).
LLADA_MOE_MASK_TOKEN_ID = 156895


def _llada_moe_dims(hf: dict) -> dict:
  """LLaDA-MoE's config read as modeling_lladamoe.py (dllm, OLMoE-derived) builds the model:
  pre-norm RMSNorm blocks, q and k RMS-normed per head (qk_layernorm) before rotate-half RoPE,
  head size hidden_size / num_attention_heads, bidirectional attention, a softmax router whose
  top-k weights are never renormalised (norm_topk_prob is hard-coded off), SwiGLU experts, and an
  optional shared expert of shared_expert_intermediate_size added to every token's output."""
  hf = dict(_LLADA_MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None})
  layers = hf['num_hidden_layers']
  freq = hf['moe_layer_freq'] or [1] * layers
  expert = int(hf['expert_intermediate_size'])
  shared = hf['shared_expert_intermediate_size'] or 0
  for ok, what in (
    (hf['hidden_act'] == 'silu', f"hidden_act={hf['hidden_act']!r} (dlmjax's experts are SwiGLU)"),
    (not hf['attention_bias'], 'attention_bias=true (dlmjax has no o_proj bias)'),
    (hf['clip_qkv'] is None, f'clip_qkv={hf["clip_qkv"]} (dlmjax does not clamp q, k, v)'),
    (
      hf['moe_router_score_function'] == 'softmax',
      f'moe_router_score_function={hf["moe_router_score_function"]!r} (the router is softmax)',
    ),
    (
      float(hf['partial_rotary_factor']) == 1.0,
      f'partial_rotary_factor={hf["partial_rotary_factor"]} (RoPE rotates every dim here)',
    ),
    (
      all(f == 1 for f in freq),
      f'moe_layer_freq={freq} (dense layers: this import has no reference forward of '
      "LLaDA-MoE's dense MLP to check them against)",
    ),
    (shared % expert == 0, f'shared_expert_intermediate_size={shared}, not a multiple of {expert}'),
  ):
    if not ok:
      raise HFConfigError(f'LLaDA-MoE config {what} cannot be imported exactly.')
  heads = hf['num_attention_heads']
  return dict(
    num_layers=layers,
    d_model=hf['hidden_size'],
    num_heads=heads,
    num_kv_heads=hf['num_key_value_heads'],
    head_dim=hf['hidden_size'] // heads,
    ffn_dim=int(hf['dense_intermediate_size']),
    num_experts=int(hf['num_experts']),
    experts_per_token=int(hf['num_experts_per_tok']),
    moe_ffn_dim=expert,
    dense_layers='',
    shared_experts=shared // expert,
    router='softmax_topk_raw',
    vocab_size=hf['vocab_size'],
    **_rope(hf),
    norm_eps=float(hf['rms_norm_eps']),
    tie_embeddings=bool(hf['tie_word_embeddings']),
    seq_len=hf['max_position_embeddings'],
    qk_norm=bool(hf['qk_layernorm']),
    qkv_bias=False,
  )


def embedding_rows(hf: dict, arch: str) -> int:
  """Rows of the checkpoint's embedding (LLaDA may pad it past vocab_size: `embedding_size`)."""
  if arch == 'llada':
    return _llada(hf, 'embedding_size') or hf['vocab_size']
  return hf['vocab_size']


def has_qk_norm(arch: str) -> bool:
  return arch in ('qwen3', 'difflm', 'sdar', 'qwen3_moe')


def export_family(*, qk_norm: bool, qkv_bias: bool, shift_logits: bool = False) -> str:
  """The family whose layout and forward are exactly the model with these options (a shifted
  model: Dream's, the only one that reads token i from position i-1)."""
  if shift_logits:
    if qk_norm or not qkv_bias:
      raise HFConfigError(
        'model.shift_logits=True exports only as Dream (q/k/v biases, no QK-norm); this model has '
        f'qk_norm={bool(qk_norm)}, qkv_bias={bool(qkv_bias)}, which no family with the shift holds.'
      )
    return 'dream'
  family = EXPORT_FAMILIES.get((bool(qk_norm), bool(qkv_bias)))
  if family is None:
    raise HFConfigError(
      'model.qk_norm=True with model.qkv_bias=True has no Hugging Face family to export to '
      '(Qwen3 has QK-norm and no q/k/v-only biases, Qwen2 the biases without QK-norm).'
    )
  return family


def config_from_hf(hf: dict, base=None):
  """A dlmjax config for a Hugging Face model: `base` (or the defaults) with the model's dims.

  Special ids (mask, eos, pad) are taken when the HF config has them. A plain Qwen3/Llama is a
  causal LM; it imports with `base`'s attention mask (bidirectional by default), the usual start
  for adapting an AR model into a diffusion LM. A DiffLM keeps its `attn_mask_type`.
  """
  arch = detect_architecture(hf)
  config = config_lib.defaults() if base is None else base
  config_lib.set_model_fields(config.model, _dims(hf, arch))
  ids = dream_special_ids(hf) if arch == 'dream' else hf
  if arch == 'llada_moe':
    ids = {
      **{k: _LLADA_MOE_DEFAULTS[k] for k in ('eos_token_id', 'pad_token_id')},
      'mask_token_id': LLADA_MOE_MASK_TOKEN_ID,
      **{k: v for k, v in hf.items() if v is not None},
    }
    config.model.attention_mask = 'bidirectional'  # LLaDAMoEAttention: is_causal=False
  for key in ('mask_token_id', 'eos_token_id', 'pad_token_id'):
    value = ids.get(key)
    if isinstance(value, int) and 0 <= value < config.model.vocab_size:
      config.model[key] = value
  if arch == 'sdar':
    config.model.update(_sdar_mask(hf))
    has_mask = isinstance(hf.get('mask_token_id'), int)
    if not has_mask and SDAR_MASK_TOKEN_ID < config.model.vocab_size:
      config.model.mask_token_id = SDAR_MASK_TOKEN_ID
    if not isinstance(hf.get('pad_token_id'), int):  # SDAR pads with EOS (generation_config.json)
      config.model.pad_token_id = config.model.eos_token_id
  kind = hf.get('attn_mask_type')
  if kind is not None:
    if kind not in _MASK_KINDS:
      raise HFConfigError(f'attn_mask_type={kind!r} is not one of {_MASK_KINDS}.')
    config.model.attention_mask = kind
    if kind == 'block_causal':
      config.model.block_size = int(hf['block_size'])
  return config


def check_matches(hf: dict, config, *, missing_qk_norm: str = 'error') -> None:
  """Raises HFConfigError listing every model dimension where `config` and the checkpoint differ
  (missing_qk_norm='ones' lets a QK-norm config take a checkpoint without QK-norm)."""
  arch = detect_architecture(hf)
  dims = _dims(hf, arch)
  dims.pop('seq_len', None)  # a training choice, not a property of the weights.
  if missing_qk_norm == 'ones' and not dims['qk_norm']:
    dims.pop('qk_norm')
  dims.pop('vocab_size')  # checked against the embedding rows below.
  # Compared as parsed values: 'factor=8' and 'factor=8.0' are one scaling.
  ours = {k: config_lib.model_field(config.model, k) for k in dims}
  ours['rope_scaling'] = config_lib.parse_rope_scaling(config.model.rope_scaling)
  dims['rope_scaling'] = config_lib.parse_rope_scaling(dims['rope_scaling'])
  if 'dense_layers' in dims:  # compared as indices: '0, 2' and '2,0' are one set
    ours['dense_layers'] = ','.join(map(str, config_lib.dense_layers(config.model)))
  differing = [
    f'model.{config_lib.MODEL_FIELD_KEYS.get(k, k)}: checkpoint {v!r}, config {ours[k]!r}'
    for k, v in dims.items()
    if ours[k] != v
  ]
  if config.model.vocab_size > embedding_rows(hf, arch):
    differing.append(
      f'model.vocab_size: the checkpoint embeds {embedding_rows(hf, arch)} rows, '
      f"fewer than the config's {config.model.vocab_size} tokens"
    )
  if differing:
    raise HFConfigError(
      'the config does not describe this checkpoint ('
      + '; '.join(differing)
      + "). Fix the config, or convert without --config to take the checkpoint's."
    )


# Our transformers classes for exports (hf_modeling/modeling_dlmjax.py, copied into every Qwen3,
# Qwen2 or Llama export): the family's class attending with the export's attn_mask_type.
MODELING_FILE = 'modeling_dlmjax.py'
_MODELING_CLASSES = dict(
  qwen3='DlmjaxQwen3ForCausalLM', qwen2='DlmjaxQwen2ForCausalLM', llama='DlmjaxLlamaForCausalLM'
)


def _qwen_fields(m, *, vocab_rows: int, dtype: str) -> dict:
  """The config.json fields Qwen2's config class defines (Qwen3's, Llama's and Dream's share
  them): sizes, norm, RoPE theta, tying, no sliding window, no KV cache, the special ids."""
  return dict(
    vocab_size=vocab_rows,
    hidden_size=m.d_model,
    intermediate_size=m.ffn_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    hidden_act='silu',
    max_position_embeddings=m.seq_len,
    initializer_range=m.init_std,
    rms_norm_eps=m.norm_eps,
    rope_theta=m.rope_theta,
    attention_dropout=0.0,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=m.num_layers,
    tie_word_embeddings=m.tie_embeddings,
    use_cache=False,
    torch_dtype={'bf16': 'bfloat16', 'fp32': 'float32'}[dtype],
    bos_token_id=None,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )


def to_hf(config, *, vocab_rows: int, dtype: str, family: str | None = None) -> dict:
  """transformers config.json of `family` (Qwen3, Qwen2 or Llama; default export_family) for a
  dlmjax config, with DiffLM's mask fields added.

  Attention: `is_causal` is the setting transformers' own masks honour (masking_utils,
  create_causal_mask: false gives the bidirectional mask), so plain `from_pretrained` computes a
  bidirectional (or causal) export exactly; `auto_map` names our class in modeling_dlmjax.py,
  which `trust_remote_code=True` loads and which computes every mask kind, block_causal too.
  `max_position_embeddings` is the training length, as MegaDLMs' converter writes it. `use_cache`
  is off: a bidirectional model must not decode with a causal KV cache.
  """
  m = config.model
  if not family and m.moe.num_experts:
    family = moe_family(qk_norm=m.qk_norm, shared_experts=m.moe.shared_experts)
  family = family or export_family(
    qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, shift_logits=m.shift_logits
  )
  if family in _MOE_TO_HF:
    return _MOE_TO_HF[family](config, vocab_rows=vocab_rows, dtype=dtype)
  if family == 'dream':
    return dream_to_hf(config, vocab_rows=vocab_rows, dtype=dtype)
  hf = _qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=[_HF_CLASSES[family]],
    auto_map=dict(AutoModelForCausalLM=f'{MODELING_FILE[:-3]}.{_MODELING_CLASSES[family]}'),
    model_type=family,
    head_dim=m.head_dim,
    rope_parameters=dict(_rope_fields(m.rope_scaling), rope_theta=m.rope_theta),
    attention_bias=False,  # Qwen3 / Llama: no biases; Qwen2 has q/k/v biases always.
    is_causal=m.attention_mask == 'causal',
    dtype=hf['torch_dtype'],
    attn_mask_type=m.attention_mask,
  )
  if m.attention_mask == 'block_causal':
    hf['block_size'] = m.block_size
  if m.rope_scaling:  # transformers v4 reads the scaling here, v5 from rope_parameters.
    hf['rope_scaling'] = _rope_fields(m.rope_scaling)
  if family == 'qwen2':
    del hf['attention_bias']  # Qwen2Config has no such field.
  elif family == 'llama':
    for key in ('use_sliding_window', 'sliding_window', 'max_window_layers'):
      del hf[key]
    hf['mlp_bias'] = False
  return hf


# LLaDA's own code (configuration_llada.py, modeling_llada.py) is not ours to ship: an export's
# auto_map names it in the Hub repository it comes from ("repo--module.Class", transformers'
# dynamic-module reference), as save_pretrained writes remote code that lives elsewhere.
LLADA_CODE_REPO = 'GSAI-ML/LLaDA-8B-Instruct'


def _hub_auto_map(repo: str, **classes: str) -> dict:
  """config.json's auto_map for code kept in a Hub repository: Auto class -> module.Class."""
  return {name: f'{repo}--{target}' for name, target in classes.items()}


def llada_to_hf(config, *, vocab_rows: int, dtype: str) -> dict:
  """LLaDA's config.json (LLaDAConfig's fields, as GSAI-ML/LLaDA-8B-* ship them) for a dlmjax
  model with LLaDA's architecture (hf_layouts refuses the others): the `llama` block, RMSNorm,
  silu(ff_proj) * up_proj, rotate-half RoPE, bidirectional attention. `vocab_size` is the
  model's vocabulary, `embedding_size` the rows written (LLaDA pads the embedding past it)."""
  m = config.model
  hf = dict(_LLADA_DEFAULTS)
  hf.update(
    architectures=['LLaDAModelLM'],
    auto_map=_hub_auto_map(
      LLADA_CODE_REPO,
      AutoConfig='configuration_llada.LLaDAConfig',
      AutoModelForCausalLM='modeling_llada.LLaDAModelLM',
      AutoModel='modeling_llada.LLaDAModelLM',
    ),
    model_type='llada',
    block_type='llama',
    layer_norm_type='rms',
    activation_type='silu',
    rope=True,
    rope_full_precision=True,
    bias_for_layer_norm=False,
    alibi_bias_max=8.0,
    attention_layer_norm_with_affine=True,
    include_qkv_bias=bool(m.qkv_bias),
    d_model=m.d_model,
    n_heads=m.num_heads,
    n_kv_heads=m.num_kv_heads,
    n_layers=m.num_layers,
    mlp_hidden_size=m.ffn_dim,
    mlp_ratio=max(1, m.ffn_dim // m.d_model),  # unused when mlp_hidden_size is set.
    vocab_size=m.vocab_size,
    embedding_size=vocab_rows,
    max_sequence_length=m.seq_len,
    rope_theta=m.rope_theta,
    rms_norm_eps=m.norm_eps,
    weight_tying=bool(m.tie_embeddings),
    init_std=m.init_std,
    init_device='meta',
    init_fn='mitchell',
    attention_dropout=0.0,
    residual_dropout=0.0,
    embedding_dropout=0.0,
    flash_attention=False,
    precision={'bf16': 'amp_bf16', 'fp32': 'fp32'}[dtype],
    use_cache=False,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )
  return hf


# Dream's code (configuration_dream.py, modeling_dream.py) is not ours to ship: the export's
# auto_map names it in the Hub repository it comes from ("repo--module.Class", transformers'
# dynamic-module reference), under the class names Dream's own config.json gives.
DREAM_CODE_REPO = 'Dream-org/Dream-v0-Base-7B'


def dream_cannot_hold(m) -> str | None:
  """Why Dream's layout cannot represent a model (config.model or ModelConfig), or None: Dream
  is Qwen2's block with q/k/v biases and no QK-norm, head size hidden_size / num_heads,
  bidirectional attention and the shifted prediction (modeling_dream.py, generation_utils.py)."""
  if m.qk_norm:
    return 'the dream layout has no QK-norm'
  if not m.qkv_bias:
    return 'the dream layout has q/k/v biases (DreamAttention: bias=True), the model has none'
  if not m.shift_logits:
    return (
      'the dream layout reads token i from position i-1 (model.shift_logits=True), the model '
      'predicts each token at its own position'
    )
  if m.num_heads * m.head_dim != m.d_model:
    return (
      f'the dream layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if m.attention_mask != 'bidirectional':
    return f'the dream layout attends bidirectionally, the model is {m.attention_mask}'
  return None


def dream_to_hf(config, *, vocab_rows: int, dtype: str) -> dict:
  """Dream's config.json (DreamConfig's fields, as Dream-org/Dream-v0-*-7B ship them) for a
  model dream_cannot_hold accepts; refuses any other with the reason."""
  m = config.model
  why = dream_cannot_hold(m)
  if why is not None:
    raise HFConfigError(f'cannot export as Dream: {why}.')
  hf = _qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['DreamModel'],
    auto_map=_hub_auto_map(
      DREAM_CODE_REPO,
      AutoConfig='configuration_dream.DreamConfig',
      AutoModel='modeling_dream.DreamModel',
    ),
    model_type='Dream',
    rope_scaling=None,
  )
  return hf


def moe_family(*, qk_norm: bool, shared_experts: int) -> str:
  """The MoE family an MoE model exports to by default: Qwen3-MoE's when it has QK-norm and no
  shared experts, else LLaDA-MoE's (hf_layouts says whether that one can hold it)."""
  return 'qwen3_moe' if qk_norm and not shared_experts else 'llada_moe'


def qwen3_moe_to_hf(config, *, vocab_rows: int, dtype: str) -> dict:
  """transformers' Qwen3MoeConfig config.json (as Qwen/Qwen3-30B-A3B ships it) for a dlmjax MoE
  model the qwen3_moe layout holds (hf_layouts): Qwen3's attention, model.moe.dense_layers as
  mlp_only_layers (with decoder_sparse_step 1 every layer not listed is sparse), the
  router's renormalisation as norm_topk_prob. Attention as to_hf's exports: `is_causal`, which
  transformers' own masks honour (bidirectional or causal; block_causal is refused)."""
  m = config.model
  hf = _qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['Qwen3MoeForCausalLM'],
    model_type='qwen3_moe',
    head_dim=m.head_dim,
    rope_parameters=dict(_rope_fields(m.rope_scaling), rope_theta=m.rope_theta),
    attention_bias=False,
    is_causal=m.attention_mask == 'causal',
    dtype=hf['torch_dtype'],
    attn_mask_type=m.attention_mask,
    decoder_sparse_step=1,
    mlp_only_layers=list(config_lib.dense_layers(m)),
    moe_intermediate_size=m.moe.ffn_dim or m.ffn_dim,
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    norm_topk_prob=m.moe.router == 'softmax_topk',
    output_router_logits=False,
    router_aux_loss_coef=config.model.moe.balance_loss,
  )
  if m.rope_scaling:
    hf['rope_scaling'] = _rope_fields(m.rope_scaling)
  return hf


# LLaDA-MoE's code (modeling_lladamoe.py) is not ours to ship: as for LLaDA, the export's auto_map
# names it in the Hub repository it comes from.
LLADA_MOE_CODE_REPO = 'inclusionAI/LLaDA-MoE-7B-A1B-Base'


def llada_moe_to_hf(config, *, vocab_rows: int, dtype: str) -> dict:
  """LLaDA-MoE's config.json (LLaDAMoEConfig's fields; model_type 'llada' as the release keeps
  it, architectures LLaDAMoEModelLM) for a model the llada_moe layout holds (hf_layouts)."""
  m = config.model
  expert = m.moe.ffn_dim or m.ffn_dim
  return dict(
    architectures=['LLaDAMoEModelLM'],
    auto_map=_hub_auto_map(
      LLADA_MOE_CODE_REPO,
      AutoConfig='configuration_lladamoe.LLaDAMoEConfig',
      AutoModel='modeling_lladamoe.LLaDAMoEModelLM',
      AutoModelForCausalLM='modeling_lladamoe.LLaDAMoEModelLM',
    ),
    model_type='llada',
    vocab_size=vocab_rows,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    hidden_act='silu',
    max_position_embeddings=m.seq_len,
    initializer_range=m.init_std,
    rms_norm_eps=m.norm_eps,
    use_cache=False,
    tie_word_embeddings=bool(m.tie_embeddings),
    attention_dropout=0.0,
    attention_bias=False,
    clip_qkv=None,
    dense_intermediate_size=m.ffn_dim,
    expert_intermediate_size=expert,
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    shared_expert_intermediate_size=m.moe.shared_experts * expert or None,
    moe_layer_freq=[1] * m.num_layers,
    qk_layernorm=bool(m.qk_norm),
    moe_router_score_function='softmax',
    moe_router_enable_expert_bias=False,
    output_router_logits=False,
    router_aux_loss_coef=config.model.moe.balance_loss,
    norm_topk_prob=False,
    rope_theta=m.rope_theta,
    rope_scaling=None,
    partial_rotary_factor=1.0,
    torch_dtype={'bf16': 'bfloat16', 'fp32': 'float32'}[dtype],
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )


_MOE_TO_HF = dict(qwen3_moe=qwen3_moe_to_hf, llada_moe=llada_moe_to_hf)
# SDAR's code (configuration_sdar.py, modeling_sdar.py and the fused loss file it imports) is not
# ours to ship: the export's auto_map names it in the Hub repository it comes from, under the class
# names SDAR-*-Chat's config.json gives (the dense sizes ship the same files).
SDAR_CODE_REPO = 'JetLM/SDAR-4B-Chat'
# The fields SDAR-*-Chat's config.json carries for SDAR's training code (modeling_sdar.py reads
# fuse_cross_entropy; the rest configure its trainer), with the released values.
_SDAR_TRAINING_FIELDS = dict(
  attn_implementation='flex_attention',
  fuse_cross_entropy=True,
  micro_forward=False,
  use_deepep=False,
  ep_size=1,
  skip_checkpoint=False,
  debug=False,
)


def sdar_cannot_hold(m) -> str | None:
  """Why SDAR's layout cannot represent a model (config.model or ModelConfig), or None: SDAR is
  Qwen3's block (QK-norm, no biases) predicting each token at its own position, decoded with
  block-causal attention over config.json's block_size (modeling_sdar.py, generate.py)."""
  if not m.qk_norm:
    return 'the sdar layout has QK-norm (SDARAttention q_norm / k_norm), the model has none'
  if m.qkv_bias:
    return 'the sdar layout has no q/k/v-only biases (attention_bias adds an o_proj bias too)'
  if m.shift_logits:
    return 'the sdar layout predicts each token at its own position (no shift)'
  if m.attention_mask != 'block_causal':
    return (
      f'the sdar layout attends block-causally (SDAR decodes block by block), the model is '
      f'{m.attention_mask}'
    )
  return None


def sdar_to_hf(config, *, vocab_rows: int, dtype: str) -> dict:
  """SDAR's config.json (SDARConfig's fields, as JetAstra/SDAR's SDAR-*-Chat ship them, which
  JetEngine reads too) for a model sdar_cannot_hold accepts; refuses any other with the reason.
  `block_size` and `mask_token_id` are the model's, as SDAR's training code reads them."""
  m = config.model
  why = sdar_cannot_hold(m)
  if why is not None:
    raise HFConfigError(f'cannot export as SDAR: {why}.')
  hf = _qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['SDARForCausalLM'],
    auto_map=_hub_auto_map(
      SDAR_CODE_REPO,
      AutoConfig='configuration_sdar.SDARConfig',
      AutoModel='modeling_sdar.SDARModel',
      AutoModelForCausalLM='modeling_sdar.SDARForCausalLM',
    ),
    model_type='sdar',
    head_dim=m.head_dim,
    attention_bias=False,
    rope_scaling=_rope_fields(m.rope_scaling) if m.rope_scaling else None,
    block_size=m.block_size,
    bos_token_id=m.eos_token_id,  # SDAR-*-Chat: BOS = EOS = <|endoftext|>.
    **_SDAR_TRAINING_FIELDS,
  )
  # SDAR's config.json has no pad_token_id (it pads with EOS, generation_config.json), and
  # modeling_sdar.py makes config.pad_token_id the embedding's padding_idx, whose row then gets
  # no gradient: the field is written only for a model that pads with another token.
  if m.pad_token_id == m.eos_token_id:
    del hf['pad_token_id']
  return hf
