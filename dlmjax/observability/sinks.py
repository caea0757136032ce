"""Metric sinks the Reporter feeds with each logged row: TensorBoard (default), W&B (opt-in).

Only process 0 writes. A sink takes `write(step, row)` and `close()`; rows are flat dicts of
floats (loss, masked_ce, lr, grad_norm, tokens_per_s, mfu, memory, and whatever else a stage or
evaluation logs, e.g. reward stats or val_loss), so new metrics need no change here.
"""

from __future__ import annotations

import os

import jax

from dlmjax import config as config_lib
from dlmjax.observability import choices, tensorboard

TENSORBOARD_DIR = 'tensorboard'
OUTPUTS = choices.OUTPUTS  # log.outputs


class TensorBoardSink:
  def __init__(self, log_dir: str):
    self.writer = tensorboard.EventWriter(log_dir)

  def write(self, step: int, row: dict) -> None:
    self.writer.scalars(step, {k: v for k, v in row.items() if k != 'step'})

  def close(self) -> None:
    self.writer.close()


class WandbSink:
  """Weights & Biases in offline mode (sync later with `wandb sync OUTPUT_DIR/wandb/...`)."""

  def __init__(self, config, run_dir: str):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise config_lib.ConfigError(
        'log.outputs names wandb, which is not installed: `pip install wandb`, or leave it '
        'out of --config.log.outputs.'
      ) from e
    self._run = wandb.init(
      project=os.environ.get('WANDB_PROJECT', 'dlmjax'),
      dir=run_dir,
      mode='offline',
      name=os.path.basename(os.path.abspath(run_dir)),
      config=config.to_dict(),
    )

  def write(self, step: int, row: dict) -> None:
    self._run.log({k: v for k, v in row.items() if k != 'step'}, step=step)

  def close(self) -> None:
    self._run.finish()


def check_installed(config) -> None:
  """Before any model is built: the one-line ConfigError of a sink whose package is missing."""
  if 'tensorboard' in config_lib.log_outputs(config):
    tensorboard.check_installed()


def make_sinks(config, run_dir: str) -> list:
  """The sinks config.log asks for; empty on processes other than 0."""
  if jax.process_index() != 0:
    return []
  sinks = []
  outputs = config_lib.log_outputs(config)
  if 'tensorboard' in outputs:
    sinks.append(TensorBoardSink(os.path.join(run_dir, TENSORBOARD_DIR)))
  if 'wandb' in outputs:
    sinks.append(WandbSink(config, run_dir))
  return sinks
