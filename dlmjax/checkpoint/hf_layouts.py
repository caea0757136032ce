"""The Hugging Face layouts an export can write (`convert to-hf --layout`), one table entry each.

A layout is a family's tensor names (hf_mapping.NAMINGS), its config.json (hf_config), the
model options it can hold, and the source families (an import's `source.family` in checkpoint
metadata) that export back to it. `source`, the default, picks the layout of the family the
checkpoint came from, else the one the model's options choose (hf_config.export_family). A
layout that cannot hold the model is refused with one line naming one that can. A new family
adds one `Layout` to LAYOUTS (register).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dlmjax.checkpoint import hf_config

SOURCE = 'source'


@dataclasses.dataclass(frozen=True)
class Layout:
  """One export layout.

  names: key of hf_mapping.NAMINGS. families: source families exported to it by default.
  cannot_hold(model config) -> why the layout cannot represent that model, or None.
  config_json(config, vocab_rows=, dtype=) -> config.json. ships_modeling: copy our
  modeling_dlmjax.py beside the weights (config.json's auto_map names its class).
  """

  name: str
  names: str
  families: tuple
  cannot_hold: Callable
  config_json: Callable
  ships_modeling: bool = False


def _transformers_family(family: str) -> Callable:
  """A Qwen3 / Qwen2 / Llama layout holds exactly the options export_family maps to it:
  Qwen3's QK-norm, Qwen2's q/k/v biases (always present in Qwen2Attention), Llama neither
  (LlamaConfig.attention_bias would add an o_proj bias too)."""

  def cannot_hold(m) -> str | None:
    if m.num_experts:
      return f'the {family} layout has a dense MLP, the model has {m.num_experts} experts'
    if getattr(m, 'shift_logits', False):
      return f'the {family} layout predicts each token at its own position (no shift)'
    wanted = {v: k for k, v in hf_config.EXPORT_FAMILIES.items()}[family]
    have = (bool(m.qk_norm), bool(m.qkv_bias))
    if have == wanted:
      return None
    parts = []
    if have[0] != wanted[0]:
      parts.append('has QK-norm weights' if wanted[0] else 'has no QK-norm')
    if have[1] != wanted[1]:
      parts.append('has q/k/v biases' if wanted[1] else 'has no q/k/v biases')
    return f'the {family} layout {" and ".join(parts)}'

  return cannot_hold


def _llada_cannot_hold(m) -> str | None:
  """LLaDA's `llama` block: no QK-norm, heads that tile d_model (attn_out is d_model x d_model,
  head size d_model / n_heads), and bidirectional attention only (modeling_llada.py)."""
  if m.num_experts:
    return f'the llada layout has a dense MLP, the model has {m.num_experts} experts'
  if m.qk_norm:
    return 'the llada layout has no QK-norm'
  if m.num_heads * m.head_dim != m.d_model:
    return (
      f'the llada layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if m.attention_mask != 'bidirectional':
    return f'the llada layout attends bidirectionally, the model is {m.attention_mask}'
  if m.rope_scaling:
    return f'the llada layout has no RoPE scaling (the model has {m.rope_scaling!r})'
  if m.shift_logits:
    return 'the llada layout predicts each token at its own position (no shift)'
  return None


def _dream_cannot_hold(m) -> str | None:
  if m.num_experts:
    return f'the dream layout has a dense MLP, the model has {m.num_experts} experts'
  if m.rope_scaling:
    return f'the dream layout has no RoPE scaling (the model has {m.rope_scaling!r})'
  return hf_config.dream_cannot_hold(m)


def _sdar_cannot_hold(m) -> str | None:
  if m.num_experts:  # SDAR-30B-A3B's MoE blocks are refused at import
    return f'the sdar layout has a dense MLP, the model has {m.num_experts} experts'
  return hf_config.sdar_cannot_hold(m)


def _moe_cannot_hold(m, family: str) -> str | None:
  """What both MoE layouts need: experts, a softmax router, no q/k/v biases, no logit shift."""
  if not m.num_experts:
    return f'the {family} layout has experts, the model a dense MLP (model.moe.num_experts=0)'
  if m.router == 'sigmoid_bias':
    return f'the {family} layout routes by softmax, the model by sigmoid_bias'
  if m.qkv_bias:
    return f'the {family} layout has no q/k/v biases'
  if m.shift_logits:
    return f'the {family} layout predicts each token at its own position (no shift)'
  return None


def _qwen3_moe_cannot_hold(m) -> str | None:
  """transformers' Qwen3MoeForCausalLM: Qwen3's attention (QK-norm), no shared expert, and the
  masks transformers' own classes compute from is_causal (bidirectional, causal)."""
  why = _moe_cannot_hold(m, 'qwen3_moe')
  if why is None and not m.qk_norm:
    why = 'the qwen3_moe layout has QK-norm weights'
  if why is None and m.shared_experts:
    why = 'the qwen3_moe layout has no shared experts'
  if why is None and m.attention_mask == 'block_causal':
    why = 'the qwen3_moe layout attends bidirectionally or causally, the model is block_causal'
  return why


def _llada_moe_cannot_hold(m) -> str | None:
  """LLaDA-MoE (modeling_lladamoe.py): the raw top-k softmax weights, head size d_model /
  num_heads, bidirectional attention."""
  why = _moe_cannot_hold(m, 'llada_moe')
  if why is None and getattr(m, 'dense_layers', ''):
    why = 'the llada_moe export writes every layer MoE, the model has dense layers'
  if why is None and m.router != 'softmax_topk_raw':
    why = (
      'the llada_moe layout never renormalises the top-k weights '
      '(model.moe.router=softmax_topk_raw)'
    )
  if why is None and m.num_heads * m.head_dim != m.d_model:
    why = (
      f'the llada_moe layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if why is None and m.attention_mask != 'bidirectional':
    why = f'the llada_moe layout attends bidirectionally, the model is {m.attention_mask}'
  return why


def _family_config(family: str) -> Callable:
  def config_json(config, *, vocab_rows: int, dtype: str) -> dict:
    return hf_config.to_hf(config, vocab_rows=vocab_rows, dtype=dtype, family=family)

  return config_json


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> None:
  LAYOUTS[layout.name] = layout


for _family, _sources in (
  ('qwen3', ('qwen3', 'difflm')),
  ('qwen2', ('qwen2',)),
  ('llama', ('llama',)),
):
  register(
    Layout(
      name=_family,
      names=_family,
      families=_sources,
      cannot_hold=_transformers_family(_family),
      config_json=_family_config(_family),
      ships_modeling=True,
    )
  )
# The DLM families' own layouts, each its family's names and config.json: LLaDA's, Dream's, SDAR /
# TraDo's (Qwen3's tensor names under SDAR's config.json: model_type sdar, block_size), and the
# MoE families'.
for _family, _cannot_hold, _config_json in (
  ('llada', _llada_cannot_hold, hf_config.llada_to_hf),
  ('dream', _dream_cannot_hold, hf_config.dream_to_hf),
  ('sdar', _sdar_cannot_hold, hf_config.sdar_to_hf),
  ('qwen3_moe', _qwen3_moe_cannot_hold, hf_config.qwen3_moe_to_hf),
  ('llada_moe', _llada_moe_cannot_hold, hf_config.llada_moe_to_hf),
):
  register(
    Layout(
      name=_family,
      names=_family,
      families=(_family,),
      cannot_hold=_cannot_hold,
      config_json=_config_json,
    )
  )


def choices() -> list[str]:
  return [SOURCE, *LAYOUTS]


def for_family(family: str | None) -> Layout | None:
  """The layout a source family exports back to, or None (unknown or unrecorded family)."""
  for layout in LAYOUTS.values():
    if family in layout.families:
      return layout
  return None


def choose(name: str, model, *, source_family: str | None = None) -> Layout:
  """The layout `name` (or, for `source`, the source family's, else the options' choice) for a
  model (its ModelConfig); raises HFConfigError when it cannot hold the model."""
  if name == SOURCE:
    layout = for_family(source_family)
    if layout is None:
      layout = LAYOUTS[_options_family(model)]
  elif name in LAYOUTS:
    layout = LAYOUTS[name]
  else:
    raise hf_config.HFConfigError(f'--layout={name!r} is not one of {", ".join(choices())}.')
  why = layout.cannot_hold(model)
  if why is not None:
    able = [other.name for other in LAYOUTS.values() if other.cannot_hold(model) is None]
    instead = f'use --layout={able[0]}' if able else 'no layout can hold it'
    raise hf_config.HFConfigError(f'cannot export with --layout={layout.name}: {why}; {instead}.')
  return layout


def _options_family(model) -> str:
  if model.num_experts:
    return hf_config.moe_family(qk_norm=model.qk_norm, shared_experts=model.shared_experts)
  return hf_config.export_family(
    qk_norm=model.qk_norm, qkv_bias=model.qkv_bias, shift_logits=model.shift_logits
  )
