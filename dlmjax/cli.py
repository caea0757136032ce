"""Shared entry-point plumbing: bad flags and user errors as one readable line, no traceback."""

from __future__ import annotations

import sys

from absl import app, flags, logging

from dlmjax import config as config_lib
from dlmjax.checkpoint import manager
from dlmjax.data import errors as data_errors
from dlmjax.model import presets
from dlmjax.train import guards
from dlmjax.train import loop


def user_errors() -> tuple[type[BaseException], ...]:
  """Errors caused by the user's input: reported as `error: <message>` with exit code 2."""
  return (
    config_lib.ConfigError,
    manager.CheckpointError,
    data_errors.DataError,
    loop.NonFiniteError,
    guards.ResourceError,
  )


def fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def run(main, config_file: str | None = None) -> None:
  """app.run(main) with readable errors for bad flags and for user errors raised by main.

  With config_file, the command line's --config=FILE[:ARG] (default config_file) and
  --config.KEY=VALUE overrides (and --config.model.preset=NAME: a model/presets.py preset's
  fields) are read by config.parse_command_line and main is called as
  main(argv, config); absl parses the other flags.
  """
  loaded = {}

  def parse_flags(argv):
    if config_file is not None:
      try:
        loaded['config'], argv = config_lib.parse_command_line(argv, config_file, presets.PRESETS)
      except config_lib.ConfigError as e:
        fail(str(e))
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      fail(str(e))

  def guarded(argv):
    # Library INFO logs (orbax, jax backends) drown the progress line; --verbosity=0 shows them.
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv, loaded['config']) if config_file is not None else main(argv)
    except user_errors() as e:
      fail(str(e))

  app.run(guarded, flags_parser=parse_flags)
