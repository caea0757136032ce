"""Shared entry-point plumbing: bad flags and user errors as one readable line, no traceback."""

from __future__ import annotations

import sys

from absl import app, flags, logging

from dlmjax import config as config_lib
from dlmjax.checkpoint import manager
from dlmjax.data import errors as data_errors
from dlmjax.train import guards
from dlmjax.train import loop


def user_errors() -> tuple[type[BaseException], ...]:
  """Errors caused by the user's input: reported as `error: <message>` with exit code 2."""
  return (config_lib.ConfigError, manager.CheckpointError, data_errors.DataError,
          loop.NonFiniteError, guards.ResourceError)


def fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections raises these for an unknown or mistyped --config.x override.
    message = str(e).strip('\'"').replace('\\n', ' ').replace('\\\'', '\'')
    fail(f'bad --config override: {message}. Every key and its type is in dlmjax/config.py.')


def run(main) -> None:
  """app.run(main) with readable errors for bad flags and for user errors raised by main."""

  def guarded(argv):
    # Library INFO logs (orbax, jax backends) drown the progress line; --verbosity=0 shows them.
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except user_errors() as e:
      fail(str(e))
    except OSError as e:
      if 'Failed loading config file' not in str(e):
        raise
      # ml_collections defers a missing/broken config file's error to the first access.
      detail = ' '.join(line.strip() for line in str(e).splitlines()[2:])
      fail(f'cannot load the --config file: {detail}')

  app.run(guarded, flags_parser=_parse_flags)
