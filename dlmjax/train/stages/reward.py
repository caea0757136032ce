"""The reward stage: a reward model (a scalar score head on the model, any family) trained on
preference pairs with the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected))
(dlmjax/rl/reward_model.py), for RL against a learned reward (rl.reward_model).

It reads the preference stage's pairs (preference.train_file / eval_file, the built-in pairs
with data.source=builtin) through that stage's batch source and row builder, without a
reference; the score reads the clean sequence (no masking), so no diffusion loss is involved.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import reward_model
from dlmjax.train.stages import base, preference

KEYS = ('tokens', 'rejected', 'prompt_lengths')


def make_loss(config):
  """loss(module, tokens=, rejected=, prompt_lengths=) -> (objective, sums): the pairs'
  Bradley-Terry loss summed over the global batch's rows (each micro-batch's share of the mean)."""
  pad_id, global_rows = config.model.eos_token_id, config.train.global_batch_size

  def fn(module, *, step=None, micro_index=None, example_ids_B=None, **arrays):
    del step, micro_index, example_ids_B  # no randomness: the clean rows are scored
    chosen_B, rejected_B = reward_model.pair_scores(
      module, arrays['tokens'], arrays['rejected'], pad_id
    )
    loss_B, margin_B = reward_model.bradley_terry(chosen_B, rejected_B)
    return jnp.sum(loss_B) / global_rows, preference.pair_sums(loss_B, margin_B, arrays)

  return fn


def metrics(sums) -> dict:
  return preference.pair_metrics(sums, 'reward_accuracy')


@functools.lru_cache(maxsize=8)
def _pair_program(model_config, pad_id: int):
  def fn(params, chosen, rejected):
    module = model_lib.merge(model_config, params)
    return reward_model.pair_scores(module, chosen, rejected, pad_id)

  return programs.jit_program(fn, model_config.matmul_dtype)


class HeldOutRewards:
  """The stage's Evaluator: on held-out pairs, the accuracy (r(chosen) > r(rejected)) and the
  mean margin r(chosen) - r(rejected)."""

  def __init__(self, config, setup, rows: dict):
    self.config, self.setup, self.rows = config, setup, rows
    self.program = _pair_program(setup.model_config, config.model.eos_token_id)

  def margins(self, params) -> np.ndarray:
    """r(chosen) - r(rejected) of each held-out pair under the model's params."""
    out = []
    for batch in preference.held_out_batches(self.config, self.rows):
      with rules.activation_mesh(self.setup.mesh):
        win, lose = distributed.to_host(self.program(params, batch['tokens'], batch['rejected']))
      out.append(np.asarray(win, np.float64) - np.asarray(lose, np.float64))
    return np.concatenate(out)

  def run(self, step: int, params) -> dict:
    margins = self.margins(params)
    row = dict(
      step=step,
      val_reward_accuracy=float((margins > 0).mean()),
      val_margin=float(margins.mean()),
      val_pairs=len(margins),
    )
    if jax.process_index() == 0:
      print(
        f'step {step}: val_reward_accuracy {row["val_reward_accuracy"]:.4f} | val_margin '
        f'{row["val_margin"]:.4f} ({row["val_pairs"]} held-out pairs)',
        flush=True,
      )
    return row


def stage(config) -> base.Stage:
  """The reward stage (its pairs are the preference stage's, checked the same way)."""

  def batches(setup, process_index, process_count):
    rows = preference.build_rows(config, preference.train_file(config))
    return preference.PairBatches(
      config,
      setup,
      None,
      rows,
      process_index=process_index,
      process_count=process_count,
      keys=KEYS,
    )

  def evaluator(setup):
    path = preference.eval_file(config)
    rows = preference.build_rows(config, path, log=lambda line: print(f'held-out {line}'))
    return HeldOutRewards(config, setup, rows)

  return base.Stage(
    name='reward',
    loss=make_loss(config),
    batch_keys=KEYS,
    metrics=metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=lambda rng: preference.example_pairs(config, rng),
    console_metrics=('margin', 'reward_accuracy'),
    check_inputs=lambda: preference.check_files(config),
    loss_is_objective=True,
    data_keys=preference.PAIR_DATA_KEYS,
  )
