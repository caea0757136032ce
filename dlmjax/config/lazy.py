"""References 'package.module:ATTR' to a registry's members, imported when a run first needs one:
a registry lists and validates its names from its table alone, so a config is checked before
jax and the model load (a config error comes in a fraction of a second)."""

from __future__ import annotations

import importlib


def load(reference: str):
  """The object a 'package.module:ATTR' reference names (its module imported on first use)."""
  module, _, attribute = reference.partition(':')
  return getattr(importlib.import_module(module), attribute)
