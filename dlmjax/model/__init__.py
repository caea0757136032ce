"""The model: a Transformer and pure functions of its parameter dict (model/functional.py).

The package's names load on first use (PEP 562 `__getattr__`), so that importing a jax-free
module of the package (choices, config_checks) does not import jax and flax: a config is checked
before they load.
"""

from __future__ import annotations

import importlib

_PUBLIC = {  # name -> the module that defines it
  'ModelConfig': 'dlmjax.model.presets',
  'PRESETS': 'dlmjax.model.presets',
  'apply_preset': 'dlmjax.model.presets',
  'Transformer': 'dlmjax.model.transformer',
  'computed_params': 'dlmjax.model.transformer',
  'inference_config': 'dlmjax.model.transformer',
  'abstract': 'dlmjax.model.functional',
  'inference_module': 'dlmjax.model.functional',
  'init_params': 'dlmjax.model.functional',
  'merge': 'dlmjax.model.functional',
  'param_placement': 'dlmjax.model.functional',
  'splits_projections': 'dlmjax.model.functional',
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value  # found directly from now on
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))
