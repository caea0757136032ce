"""The Hugging Face layouts an export can write (`convert to-hf --layout`), one table entry each.

A layout is a family's tensor names (hf_mapping.NAMINGS), its config.json (hf_config), the
model options it can hold, and the source families (an import's `source.family` in checkpoint
metadata) that export back to it. `source`, the default, picks the layout of the family the
checkpoint came from, else the one the model's options choose (hf_config.export_family). A
layout that cannot hold the model is refused with one line naming one that can. Every family
with a config.json writer (checkpoint/families) is a layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dlmjax.checkpoint import families
from dlmjax.checkpoint import hf_config

SOURCE = 'source'


@dataclasses.dataclass(frozen=True)
class Layout:
  """One export layout.

  names: key of hf_mapping.NAMINGS. families: source families exported to it by default.
  cannot_hold(model config) -> why the layout cannot represent that model, or None.
  config_json(config, vocab_rows=, dtype=) -> config.json. ships_modeling: copy our
  modeling_dlmjax.py beside the weights (config.json's auto_map names its class).
  sequence_classification: the family's transformers class for a reward model, or ''.
  """

  name: str
  names: str
  families: tuple
  cannot_hold: Callable
  config_json: Callable
  ships_modeling: bool = False
  sequence_classification: str = ''


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> None:
  LAYOUTS[layout.name] = layout


# One layout per family with a config.json writer (checkpoint/families), in the registry's order:
# its names, what it cannot hold, its config.json, and the source families exported back to it.
for _family in families.exporting():
  register(
    Layout(
      name=_family.name,
      names=_family.name,
      families=families.sources_of(_family),
      cannot_hold=_family.cannot_hold,
      config_json=_family.write,
      ships_modeling=_family.ships_modeling,
      sequence_classification=_family.sequence_classification,
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
  why = layout.cannot_hold(model) or _cannot_score(layout, model)
  if why is not None:
    able = [
      other.name
      for other in LAYOUTS.values()
      if other.cannot_hold(model) is None and _cannot_score(other, model) is None
    ]
    instead = f'use --layout={able[0]}' if able else 'no layout can hold it'
    raise hf_config.HFConfigError(f'cannot export with --layout={layout.name}: {why}; {instead}.')
  return layout


def _cannot_score(layout: Layout, model) -> str | None:
  """Why a layout cannot hold a reward model (ModelConfig.score_head), or None."""
  if not getattr(model, 'score_head', False):
    return None
  if not layout.sequence_classification:
    return f'the {layout.name} layout has no sequence-classification class for a reward model'
  if model.attention_mask == 'block_causal':
    return f'{layout.sequence_classification} attends causally or bidirectionally, not by block'
  return None


def sequence_classification_json(layout: Layout, hf: dict, config) -> dict:
  """A reward model's config.json: the layout's, naming its *ForSequenceClassification class
  with one label; pad_token_id is EOS, the token its rows are padded with
  (rl/reward_model.py), so transformers pools at the same token as Transformer.scores."""
  hf = {k: v for k, v in hf.items() if k != 'auto_map'}  # our shipped classes are LMs only
  return dict(
    hf,
    architectures=[layout.sequence_classification],
    id2label={'0': 'LABEL_0'},
    label2id={'LABEL_0': 0},
    pad_token_id=config.model.eos_token_id,
  )


def _options_family(model) -> str:
  if model.num_experts:
    return hf_config.moe_family(
      router=model.router, qk_norm=model.qk_norm, shared_experts=model.shared_experts
    )
  return hf_config.export_family(
    qk_norm=model.qk_norm, qkv_bias=model.qkv_bias, shift_logits=model.shift_logits
  )
