"""What one Hugging Face family is to dlmjax (`Family`), and the parts several families share.

A family is one small module in this package: how its config.json is recognised (`detect`), read
into model.* options (`read`), written back (`write`), its tensor names (`names`, a `Naming`),
what its layout cannot hold (`cannot_hold`), and the PyTorch forward verify checks it with
(`parity`). The model stays family-agnostic: a family is a set of model options, not a class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dlmjax import config as config_lib

# Our transformers classes for exports (hf_modeling/modeling_dlmjax.py, copied into every Qwen3,
# Qwen2 or Llama export): the family's class attending with the export's attn_mask_type.
MODELING_FILE = 'modeling_dlmjax.py'
SPECIAL_IDS = ('mask_token_id', 'eos_token_id', 'pad_token_id')


class HFConfigError(ValueError):
  """A Hugging Face config we cannot represent; the message says what differs and what to do."""


@dataclasses.dataclass(frozen=True)
class Naming:
  """Tensor names of one Hugging Face architecture; `{i}` in `layer` is the layer index."""

  embed: str
  final_norm: str
  lm_head: str
  layer: str
  layer_keys: dict  # our per-layer slot -> name suffix
  bias_slots: tuple = ()  # slots whose `.bias` may exist; accepted only when all zero
  ignored: str = r'.*rotary_emb\.inv_freq$'  # buffers some exporters write (MegaDLMs does)
  zero_tensors: tuple = ()  # per-layer suffixes that may exist; accepted only when all zero
  # Per-layer suffix of a tensor holding every expert at once -> ((slot, half), ...): the slot's
  # per-expert tensors are its [e] (half None) or the half'th of its two row blocks [e, :F] /
  # [e, F:] (transformers 5's fused Qwen3MoeExperts: gate_up_proj [E, 2F, D], down_proj [E, D, F]).
  fused: tuple = ()
  # Per-layer suffix of one tensor that stacks several slots' tensors along its rows, in order
  # -> (slot, ...) (LLaDA2's attention.query_key_value: q | k | v). Those slots' layer_keys are
  # then names the import shows each row block under; exports write the one stacked tensor.
  joined: tuple = ()

  def joined_group(self, slot: str) -> tuple | None:
    """(suffix, slots) of the joined tensor holding `slot`, or None."""
    for suffix, slots in self.joined:
      if slot in slots:
        return suffix, slots
    return None

  def layer_name(self, i: int, slot: str, e: int | None = None) -> str:
    return self.layer.format(i=i) + self.layer_keys[slot].format(e=e)


def _no_refusal(_m) -> None:
  return None


def _nothing(_config, _hf) -> None:
  return None


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face family.

  detect(model_type (lower case), architectures (lower case), config.json) -> whether it is this
  family (it may raise HFConfigError for a variant that cannot be computed). `refines`: the family
  this one is a variant of (same model_type or class prefix), so it is tried before that one.
  read(config.json) -> the model.* values it determines (refusing what we cannot compute).
  special_ids(config.json) -> the mask / eos / pad ids it means (its defaults where absent);
  finish(config, config.json) adjusts the imported config after them (a mask kind, an id).
  embedding_rows(config.json) -> rows of its embedding. names: its tensor names.
  write(config, vocab_rows=, dtype=) -> its config.json, None for an import-only family (it
  exports through `exports_to`'s layout). cannot_hold(model config) -> why its layout cannot
  represent a model, or None. ships_modeling: exports carry our modeling_dlmjax.py.
  parity: the PyTorch forward verify runs on a directory of it: 'transformers' (transformers' or
  our shipped class), 'reference' (torch_reference.Reference only: its remote code is not here),
  None (no forward here reads its names; verify checks its tensors and the forward of an export).
  source_parity: whether that forward of a directory as the family ships it computes what the
  import does (Qwen3-MoE's save_pretrained config.json names no mask, so transformers attends
  causally where the import attends bidirectionally: verify runs the forward on an export).
  in_transformers: transformers ships the family's class (Qwen3-MoE), which parity loads as it
  is (config.json's is_causal is the mask); otherwise transformers parity runs our shipped class.
  reference_mask / reference_shift: what Reference attends with when config.json names no
  attn_mask_type, and whether token i is read from position i-1.
  sequence_classification: transformers' *ForSequenceClassification class of the family, the
  layout of a reward model's export (score.weight [1, D] in place of lm_head), or ''.
  """

  name: str
  detect: Callable
  read: Callable
  names: Naming
  write: Callable | None = None
  cannot_hold: Callable = _no_refusal
  refines: str = ''
  exports_to: str = ''
  special_ids: Callable = lambda hf: hf
  finish: Callable = _nothing
  embedding_rows: Callable = lambda hf: hf['vocab_size']
  ships_modeling: bool = False
  parity: str | None = 'transformers'
  in_transformers: bool = False
  source_parity: bool = True
  reference_mask: str = 'bidirectional'
  reference_shift: bool = False
  sequence_classification: str = ''  # transformers' class a reward model exports as ('' = none)


def names_match(names: list[str], prefix: str) -> bool:
  return any(n.startswith(prefix) for n in names)


# ----------------------------------------------------------------------------------------------
# Tensor names several families share (transformers' Llama / Qwen modules).

LLAMA_KEYS = dict(
  input_norm='input_layernorm.weight',
  post_attn_norm='post_attention_layernorm.weight',
  q='self_attn.q_proj.weight',
  k='self_attn.k_proj.weight',
  v='self_attn.v_proj.weight',
  o='self_attn.o_proj.weight',
  gate='mlp.gate_proj.weight',
  up='mlp.up_proj.weight',
  down='mlp.down_proj.weight',
)
QWEN3_KEYS = dict(LLAMA_KEYS, q_norm='self_attn.q_norm.weight', k_norm='self_attn.k_norm.weight')
QWEN2_KEYS = dict(
  LLAMA_KEYS,
  q_bias='self_attn.q_proj.bias',
  k_bias='self_attn.k_proj.bias',
  v_bias='self_attn.v_proj.bias',
)
LLAMA_LIKE = dict(
  embed='model.embed_tokens.weight',
  final_norm='model.norm.weight',
  lm_head='lm_head.weight',
  layer='model.layers.{i}.',
)
# Mixture-of-experts layers (docs/moe.md): the router `mlp.gate` [E, D] and per-expert SwiGLU
# projections, as Qwen/Qwen3-30B-A3B and LLaDA-MoE publish them (OLMoE / Qwen2-MoE's names).
MOE_KEYS = dict(
  {k: v for k, v in QWEN3_KEYS.items() if k not in ('gate', 'up', 'down')},
  router='mlp.gate.weight',
  expert_gate='mlp.experts.{e}.gate_proj.weight',
  expert_up='mlp.experts.{e}.up_proj.weight',
  expert_down='mlp.experts.{e}.down_proj.weight',
)


# ----------------------------------------------------------------------------------------------
# config.json fields several families share


def rope(hf: dict) -> dict:
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


def rope_fields(rope_scaling: str) -> dict:
  """The rope_type and fields a transformers config.json carries for model.rope_scaling."""
  parsed = config_lib.parse_rope_scaling(rope_scaling)
  if parsed is None:
    return dict(rope_type='default')
  kind, fields = parsed
  if 'original_max_position_embeddings' in fields:
    fields['original_max_position_embeddings'] = int(fields['original_max_position_embeddings'])
  return dict(rope_type=kind, **fields)


def transformers_dims(hf: dict, family: str, *, qk_norm: bool, qkv_bias: bool) -> dict:
  """dlmjax model.* values of a transformers Llama-style config (Qwen3, Qwen2, Llama and the
  families built on them), with the family's attention options; refuses what we cannot compute."""
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
  if not qkv_bias and hf.get('attention_bias'):
    raise HFConfigError(
      f"attention_bias=true: {family}'s o_proj then has a bias too, which dlmjax's attention lacks."
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
    **rope(hf),
    norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
    tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
    qk_norm=qk_norm,
    qkv_bias=qkv_bias,
  )
  if 'max_position_embeddings' in hf:
    dims['seq_len'] = hf['max_position_embeddings']
  return dims


def torch_dtype(dtype: str) -> str:
  return {'bf16': 'bfloat16', 'fp32': 'float32'}[dtype]


def qwen_fields(m, *, vocab_rows: int, dtype: str) -> dict:
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
    torch_dtype=torch_dtype(dtype),
    bos_token_id=None,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )


def hub_auto_map(repo: str, **classes: str) -> dict:
  """config.json's auto_map for code kept in a Hub repository ("repo--module.Class",
  transformers' dynamic-module reference, as save_pretrained writes remote code that lives
  elsewhere): Auto class -> module.Class."""
  return {name: f'{repo}--{target}' for name, target in classes.items()}


# modeling_dlmjax.py's BLOCK_CAUSAL_PREFIX (that file imports torch, so it is not imported here).
BLOCK_CAUSAL_PREFIX = 'dlmjax_block_'


def transformers_write(family: str, hf_class: str, modeling_class: str) -> Callable:
  """config.json of a Qwen3 / Qwen2 / Llama export (the `family`'s transformers class) with
  DiffLM's mask fields.

  Attention: `is_causal` is the setting transformers' own masks honour (masking_utils,
  create_causal_mask: false gives the bidirectional mask), so plain `from_pretrained` computes a
  bidirectional (or causal) export exactly; `auto_map` names our class in modeling_dlmjax.py,
  which `trust_remote_code=True` loads and which computes every mask kind, block_causal too.
  `max_position_embeddings` is the training length, as MegaDLMs' converter writes it. `use_cache`
  is off: a bidirectional model must not decode with a causal KV cache.
  """

  block_class = modeling_class.replace('Dlmjax', 'DlmjaxBlock')
  block_config_class = block_class.replace('ForCausalLM', 'Config')

  def write(config, *, vocab_rows: int, dtype: str) -> dict:
    m = config.model
    hf = qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
    hf.update(
      architectures=[hf_class],
      auto_map=dict(AutoModelForCausalLM=f'{MODELING_FILE[:-3]}.{modeling_class}'),
      model_type=family,
      head_dim=m.head_dim,
      rope_parameters=dict(rope_fields(m.rope_scaling), rope_theta=m.rope_theta),
      attention_bias=False,  # Qwen3 / Llama: no biases; Qwen2 has q/k/v biases always.
      is_causal=m.attention_mask == 'causal',
      dtype=hf.pop('torch_dtype'),  # transformers >= 4.56 writes and reads `dtype` only
      attn_mask_type=m.attention_mask,
    )
    if m.attention_mask == 'block_causal':
      hf['block_size'] = m.block_size
      # A model_type transformers does not know, its config class in our shipped file: without
      # trust_remote_code transformers refuses to load it, naming the flag, rather than attend
      # bidirectionally (its own classes have no block-causal mask).
      hf['model_type'] = BLOCK_CAUSAL_PREFIX + family
      hf['auto_map'] = dict(
        AutoConfig=f'{MODELING_FILE[:-3]}.{block_config_class}',
        AutoModelForCausalLM=f'{MODELING_FILE[:-3]}.{block_class}',
      )
    if m.rope_scaling:  # transformers v4 reads the scaling here, v5 from rope_parameters.
      hf['rope_scaling'] = rope_fields(m.rope_scaling)
    return hf

  return write


def transformers_cannot_hold(family: str, *, qk_norm: bool, qkv_bias: bool) -> Callable:
  """A Qwen3 / Qwen2 / Llama layout holds exactly its attention options: Qwen3's QK-norm, Qwen2's
  q/k/v biases (always present in Qwen2Attention), Llama neither (LlamaConfig.attention_bias
  would add an o_proj bias too)."""

  def cannot_hold(m) -> str | None:
    if m.num_experts:
      return f'the {family} layout has a dense MLP, the model has {m.num_experts} experts'
    if getattr(m, 'shift_logits', False):
      return f'the {family} layout predicts each token at its own position (no shift)'
    have = (bool(m.qk_norm), bool(m.qkv_bias))
    if have == (qk_norm, qkv_bias):
      return None
    parts = []
    if have[0] != qk_norm:
      parts.append('has QK-norm weights' if qk_norm else 'has no QK-norm')
    if have[1] != qkv_bias:
      parts.append('has q/k/v biases' if qkv_bias else 'has no q/k/v biases')
    return f'the {family} layout {" and ".join(parts)}'

  return cannot_hold


def moe_cannot_hold(m, family: str) -> str | None:
  """What the softmax-routed MoE layouts need: experts, a softmax router, no q/k/v biases, no
  logit shift."""
  if not m.num_experts:
    return f'the {family} layout has experts, the model a dense MLP (model.moe.num_experts=0)'
  if m.router == 'sigmoid_bias':
    return f'the {family} layout routes by softmax, the model by sigmoid_bias'
  if m.qkv_bias:
    return f'the {family} layout has no q/k/v biases'
  if m.shift_logits:
    return f'the {family} layout predicts each token at its own position (no shift)'
  return None


def dense_cannot_hold(m, family: str) -> str | None:
  if m.num_experts:
    return f'the {family} layout has a dense MLP, the model has {m.num_experts} experts'
  return None
