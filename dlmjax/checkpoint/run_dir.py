"""A run directory read from its files alone: the step a path names and the config it saved.

No orbax or JAX here, so a command line can read an init_from source's config and check the
run's config against it before its heavy imports (config.validate_early); everything else reads
run directories through these names too.
"""

from __future__ import annotations

import json
import os

import ml_collections

from dlmjax import config as config_lib
from dlmjax.checkpoint import steps as steps_lib

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'


class CheckpointError(config_lib.UserError, RuntimeError):
  """A checkpoint that is missing, incomplete or incompatible; the message names the fix."""


def load_run_config(run_dir: str) -> ml_collections.ConfigDict:
  path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise CheckpointError(f'{path} is missing: {run_dir} is not a dlmjax run directory.')
  with open(path) as f:
    return config_lib.from_dict(json.load(f))


def resolve_step_dir(path: str) -> tuple[str, str, int]:
  """(run_dir, step_dir, step) for a run directory (its latest step) or a step directory."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f'checkpoint path {path} does not exist.')
  if os.path.exists(os.path.join(path, CONFIG_FILE)):
    steps = steps_lib.committed_steps(os.path.join(path, CHECKPOINT_DIR))
    if not steps:
      raise CheckpointError(
        f'run directory {path} has no complete checkpoint under {CHECKPOINT_DIR}/.'
      )
    return path, os.path.join(path, CHECKPOINT_DIR, str(steps[-1])), steps[-1]
  parent = os.path.dirname(path)
  name = os.path.basename(path)
  if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:
    if not os.path.isdir(os.path.join(path, 'params')):
      raise CheckpointError(f'{path} has no params item: the checkpoint is incomplete.')
    return os.path.dirname(parent), path, int(name)
  raise CheckpointError(
    f'{path} is neither a run directory (with {CONFIG_FILE}) nor a '
    f'checkpoint step directory (<run>/{CHECKPOINT_DIR}/<step>).'
  )
