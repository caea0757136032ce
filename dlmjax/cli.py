"""Shared entry-point plumbing: bad flags and user errors as one readable line, no traceback."""

from __future__ import annotations

import sys

from absl import app, flags, logging

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import init_from
from dlmjax.checkpoint import run_dir

# Only the config layer and init_from's jax-free readers above: a command line reads and checks
# its config before importing jax and the model (check_command_line), so a config error comes in
# a fraction of a second.


def user_errors() -> tuple[type[BaseException], ...]:
  """Errors caused by the user's input (config, data, checkpoint, non-finite loss, room):
  reported as `error: <message>` with exit code 2. Each subclasses config.UserError."""
  return (config_lib.UserError,)


def fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def read_config(argv, config_file: str):
  """(config, the other arguments) of a command line (config.parse_command_line, with the preset
  table); a config error ends the program with one `error:` line."""
  try:
    return config_lib.parse_command_line(argv, config_file, config_lib.PRESETS)
  except config_lib.ConfigError as e:
    fail(str(e))


def check_command_line(config_file: str, *, source_required: bool = True) -> None:
  """Reads sys.argv's config (the file and its overrides) and refuses an error in it at once: an
  entry point calls this before its heavy imports (jax, the model, the data pipeline: seconds),
  so an unknown key, a bad value or a missing file is one line in a fraction of a second
  (config.validate_early: all but the device count, init_from's model keys adopted first, so a
  missing or unreadable source is refused here too; with source_required=False, as summary
  describes a config whose source is not trained yet, it is checked with its own model keys).
  `run` reads the same command line again (milliseconds) and validates it again in full."""
  config, _ = read_config(sys.argv, config_file)
  adopt = init_from.adopt_source_config if source_required else _adopt_if_readable
  try:
    config_lib.validate_early(config, adopt)
  except (*user_errors(), hf_config.HFConfigError) as e:
    fail(str(e))


def _adopt_if_readable(config) -> None:
  try:
    init_from.adopt_source_config(config)
  except (config_lib.ConfigError, run_dir.CheckpointError):
    pass  # not trained yet: the config's own model keys are checked


def run(main, config_file: str | None = None) -> None:
  """app.run(main) with readable errors for bad flags and for user errors raised by main.

  With config_file, the command line's --config=FILE[:ARG] (default config_file) and
  --config.KEY=VALUE overrides (and --config.model.preset=NAME: a config/presets.py preset's
  fields) are read by config.parse_command_line and main is called as
  main(argv, config); absl parses the other flags.
  """
  loaded = {}

  def parse_flags(argv):
    if config_file is not None:
      loaded['config'], argv = read_config(argv, config_file)
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
