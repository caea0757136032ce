"""Dotted keys ('model.d_model') over nested ConfigDicts and plain dicts."""

from __future__ import annotations


def get_key(config, dotted):
  """config["a"]["b"] for "a.b"."""
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def flatten(values: dict, prefix: str = '') -> dict:
  """{'a': {'b': 1}} -> {'a.b': 1}."""
  flat = {}
  for key, value in values.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def parent(config, dotted: str):
  """(the node holding dotted's leaf, the leaf's name)."""
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    node = node[part]
  return node, leaf
