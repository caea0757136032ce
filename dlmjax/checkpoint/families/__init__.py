"""The Hugging Face families dlmjax reads and writes: one module each, registered here.

FAMILIES is in the order users see them (`convert to-hf --layout` choices; the first layout that
can hold a model is the one a refusal suggests). `detect` tries the families that refine another
(an MoE variant sharing its dense base's model_type or class prefix) before the rest. A new family
is one module defining FAMILY (a base.Family) plus its line in _MODULES.
"""

from __future__ import annotations

from dlmjax.checkpoint.families import base
from dlmjax.checkpoint.families import difflm
from dlmjax.checkpoint.families import dream
from dlmjax.checkpoint.families import llada
from dlmjax.checkpoint.families import llada2_moe
from dlmjax.checkpoint.families import llada_moe
from dlmjax.checkpoint.families import llama
from dlmjax.checkpoint.families import qwen2
from dlmjax.checkpoint.families import qwen3
from dlmjax.checkpoint.families import qwen3_moe
from dlmjax.checkpoint.families import sdar

Family = base.Family
HFConfigError = base.HFConfigError

_MODULES = (qwen3, difflm, qwen2, llama, llada, sdar, dream, qwen3_moe, llada_moe, llada2_moe)
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in _MODULES}


def get(name: str) -> Family:
  if name not in FAMILIES:
    raise HFConfigError(f'unknown family {name!r}; dlmjax reads {", ".join(FAMILIES)}.')
  return FAMILIES[name]


def detect(hf: dict) -> Family:
  """The family of a config.json, from `architectures` and `model_type`."""
  names = [a.lower() for a in hf.get('architectures') or []]
  model_type = str(hf.get('model_type', '')).lower()
  variants_first = sorted(FAMILIES.values(), key=lambda f: not f.refines)
  for family in variants_first:
    if family.detect(model_type, names, hf):
      return family
  raise HFConfigError(
    f'unknown architecture (model_type={model_type!r}, architectures='
    f'{hf.get("architectures")}); dlmjax reads {", ".join(FAMILIES)}.'
  )


def exporting() -> list[Family]:
  """The families with a layout of their own (a config.json writer), in FAMILIES' order."""
  return [f for f in FAMILIES.values() if f.write is not None]


def sources_of(layout: Family) -> tuple:
  """The source families an import records that export back to `layout` by default."""
  return tuple(f.name for f in FAMILIES.values() if (f.exports_to or f.name) == layout.name)
