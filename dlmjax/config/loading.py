"""Config files and dotted overrides: the one loader, the one override applier and the command
line that combines them."""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections

from dlmjax.config import schema
from dlmjax.config.derived import set_model_fields
from dlmjax.config.errors import ConfigError
from dlmjax.config.keys import flatten, get_key, parent
from dlmjax.config.migration import old_key_message


def load_file(spec: str) -> ml_collections.ConfigDict:
  """`configs/x.py` or `configs/x.py:arg` -> that file's get_config(arg), checked for old keys.

  A key the file sets that defaults() lacks fails naming its replacement (or its closest fix).
  """
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ConfigError(
      f'cannot load the --config file {path}: it does not exist (pass a path '
      'such as configs/tiny.py[:ARG]).'
    )
  module_spec = importlib.util.spec_from_file_location('dlmjax_config_file', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except ConfigError:
    raise
  except Exception as e:  # a config file is user code: its error, one line, naming the file.
    raise ConfigError(f'cannot load the --config file {spec}: {type(e).__name__}: {e}') from e
  check_keys(config, source=path)
  return config


def check_keys(config, *, source: str = 'the config') -> None:
  """Raises ConfigError for the first key that defaults() lacks, naming what replaced it."""
  known = flatten(schema.defaults().to_dict())
  for dotted in flatten(config.to_dict()):
    if dotted not in known:
      message = old_key_message(dotted) or f'{dotted} is not a config key.'
      raise ConfigError(f'{source}: {message}')


PRESET_OVERRIDE = 'model.preset'  # not a key: the override that sets a whole preset's fields


def apply_overrides(config, overrides, presets: dict | None = None) -> ml_collections.ConfigDict:
  """Sets dotted keys in place and returns the config.

  `overrides` is a dict {dotted key: value} (values as they are, or strings parsed as the
  default's type) or a list of "dotted.key=value" / "--config.dotted.key=value" strings. An old
  key fails naming the new one; an unknown key fails naming the group's keys. With `presets`
  (config/presets.py's PRESETS, which the command lines pass; a library caller's overrides
  name a preset only when it passes them too), model.preset=NAME sets every field of that
  preset where it stands, so later overrides win.
  """
  if not isinstance(overrides, dict):
    pairs = {}
    for item in overrides:
      text = item[len('--config.') :] if item.startswith('--config.') else item
      if '=' not in text:
        raise ConfigError(f'override {item!r} is not KEY=VALUE (e.g. --config.train.steps=10).')
      key, value = text.split('=', 1)
      pairs[key] = value
    overrides = pairs
  for dotted, value in overrides.items():
    if dotted == PRESET_OVERRIDE and presets is not None:
      if value not in presets:
        raise ConfigError(f'model.preset={value!r} is not a preset; known: {sorted(presets)}.')
      set_model_fields(config.model, presets[value])
      continue
    message = old_key_message(dotted)
    if message:
      raise ConfigError(message)
    try:
      node, leaf = parent(config, dotted)
      default = node[leaf]
    except (KeyError, AttributeError, TypeError):
      raise ConfigError(_unknown_key_message(config, dotted)) from None
    if isinstance(default, ml_collections.ConfigDict):
      raise ConfigError(f'{dotted} is a group; set one of its keys ({sorted(default.keys())}).')
    node[leaf] = _parse(dotted, value, default)
  return config


def _unknown_key_message(config, dotted: str) -> str:
  """'a.b is not a config key', with the closest key of its group."""
  group, _, leaf = dotted.rpartition('.')
  try:
    node = get_key(config, group) if group else config
    names = list(node.keys())
  except (KeyError, AttributeError, TypeError):
    group, names, leaf = '', list(config.keys()), dotted.split('.')[0]
  close = difflib.get_close_matches(leaf, names, n=1)
  hint = f' Did you mean "{close[0]}"?' if close else f' {group or "The top level"} has {names}.'
  return f'{dotted} is not a config key (every key is in dlmjax/config/schema.py).{hint}'


def _parse(dotted: str, value, default):
  """value as the default's type; strings (the command line's) are parsed."""
  if default is None:
    return value
  kind = type(default)
  if isinstance(value, str) and kind is not str:
    if kind is bool:
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ConfigError(f'{dotted}={value!r} is not a bool; use true or false.')
      return value.lower() in ('true', '1')
    try:
      return kind(value)
    except ValueError as e:
      try:  # 1e-4 for an int key, or 1e6 written for 1000000
        number = float(value)
      except ValueError:
        raise ConfigError(f'{dotted}={value!r}: {e} (the default is {default!r}).') from None
      if kind is int and number != int(number):
        raise ConfigError(f'{dotted}={value!r} is not an integer.') from None
      return kind(number)
  if kind is bool or isinstance(value, bool):
    if not (kind is bool and isinstance(value, bool)):
      raise ConfigError(f'{dotted}={value!r} and its default {default!r} differ in type.')
    return value
  if kind in (int, float) and isinstance(value, (int, float)):
    if kind is int and value != int(value):
      raise ConfigError(f'{dotted}={value!r} is not an integer.')
    return kind(value)
  if not isinstance(value, kind):
    raise ConfigError(f'{dotted}={value!r} is not a {kind.__name__} (the default is {default!r}).')
  return value


def parse_command_line(argv, default_file: str, presets: dict | None = None):
  """(config, the other arguments) from a command line with --config=FILE[:ARG] and
  --config.KEY=VALUE overrides, for the CLIs: the file is loaded with load_file, the overrides
  applied with apply_overrides (with `presets` for --config.model.preset=NAME), in that order
  wherever they stand."""
  spec, overrides, rest = default_file, [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith('--config='):
      spec = arg[len('--config=') :]
    elif arg == '--config' and i + 1 < len(args):
      spec = args[i + 1]
      i += 1
    elif arg.startswith('--config.'):
      if '=' not in arg and i + 1 < len(args):
        arg = f'{arg}={args[i + 1]}'
        i += 1
      overrides.append(arg)
    else:
      rest.append(arg)
    i += 1
  return apply_overrides(load_file(spec), overrides, presets), rest
