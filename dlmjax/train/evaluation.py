"""Validation loss during training: the stage's own loss on held-out batches, comparable over time.

MegaDLMs validates with fresh random masks (reference 1.2), so two evaluations of one model
differ. Here the masks derive from config.EVAL_SEED and each held-out example's index, never from
the step, and no micro-batch is truncated: every evaluation scores the same tokens masked the same
way, and val_loss moves only when the model does. (Stage rl validates a reward instead:
dlmjax/rl/evaluation.py.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.model import programs
from dlmjax.parallel import rules
from dlmjax.train import step as step_lib


def eval_config(config):
  """The run's config with config.EVAL_SEED as the mask seed and no variable-length truncation:
  the config a stage builds its evaluation loss from."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.seed = config_lib.EVAL_SEED
  config.diffusion.varlen_prob = 0.0
  return config


def make_eval_fn(setup, loss_fn):
  """eval(params, batch, batch_index) -> the loss's sums over the batch's micro-batches."""
  config, cfg = setup.config, setup.model_config
  num_micro = config_lib.num_microbatches(config)

  def eval_fn(params, batch, batch_index):
    module = model_lib.merge(cfg, params)
    rows = next(iter(batch.values())).shape[0]
    example_ids = batch_index * rows + jnp.arange(rows)
    xs = (
      {k: step_lib.microbatch_split(v, num_micro) for k, v in batch.items()},
      step_lib.microbatch_split(example_ids, num_micro),
      jnp.arange(num_micro),
    )

    def sums_of(arrays, ids, index):
      arrays = {
        k: rules.constrain(v, (rules.BATCH,) + (None,) * (v.ndim - 1)) for k, v in arrays.items()
      }
      return loss_fn(module, step=jnp.int32(0), micro_index=index, example_ids_B=ids, **arrays)[1]

    def accumulate(total, x):
      return jax.tree.map(jnp.add, total, sums_of(*x)), None

    first = jax.eval_shape(sums_of, *jax.tree.map(lambda x: x[0], xs))
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    return jax.lax.scan(accumulate, zero, xs)[0]

  return eval_fn


class LossEvaluator:
  """The stage's loss over the first eval.batches held-out batches (a stage's Evaluator).

  loss, batch_keys and metrics are the stage's (the loss built from `eval_config`);
  make_batches(process_index, process_count) opens the held-out iterator.
  """

  def __init__(self, config, setup, loss, batch_keys, metrics, make_batches):
    self.setup, self.metrics = setup, metrics
    self._batches = make_batches(jax.process_index(), jax.process_count())
    available = len(self._batches)
    self.num_batches = min(config.eval.batches, available)
    if self.num_batches < config.eval.batches and jax.process_index() == 0:
      print(
        f'note: the valid split holds {available} global batches; evaluating on those '
        f'instead of eval.batches={config.eval.batches}.',
        flush=True,
      )
    self._sharding = rules.named_sharding(setup.mesh, (rules.BATCH,))
    jitted = programs.jit_program(
      make_eval_fn(setup, loss),
      setup.model_config.matmul_dtype,
      in_shardings=(setup.param_shardings, {k: self._sharding for k in batch_keys}, None),
      out_shardings=setup.replicated,
    )
    # Compiled now, from the first batch's shapes, so no logged interval pays for it.
    first = next(self._batches)
    shapes = {
      k: jax.ShapeDtypeStruct((v.shape[0] * jax.process_count(), *v.shape[1:]), v.dtype)
      for k, v in first.items()
    }
    with rules.activation_mesh(setup.mesh):
      self._compiled = jitted.lower(
        setup.param_shapes, shapes, jax.ShapeDtypeStruct((), jnp.int32)
      ).compile()

  def sums(self, params) -> dict[str, np.ndarray]:
    """The loss's sums over the first eval.batches held-out batches (float64, on the host)."""
    self._batches.set_state({'consumed_samples': 0})
    total = None
    for index in range(self.num_batches):
      local = next(self._batches)
      batch = {
        k: jax.make_array_from_process_local_data(self._sharding, v) for k, v in local.items()
      }
      sums = self._compiled(params, batch, jnp.int32(index))
      sums = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(sums))
      total = sums if total is None else jax.tree.map(np.add, total, sums)
    return total

  def run(self, step: int, params) -> dict[str, float]:
    """The row {'step', 'val_loss', 'val_masked_ce', ...} for metrics.jsonl; prints a line."""
    jax.block_until_ready(params)  # the train step in flight is not evaluation time
    start = time.time()
    metrics = self.metrics(self.sums(params))
    row = {'step': step}
    row.update({f'val_{k}': float(v) for k, v in metrics.items() if k != 'tokens'})
    if jax.process_index() == 0:
      shown = [f'{k} {row[k]:.4f}' for k in ('val_loss', 'val_masked_ce') if k in row]
      print(
        f'step {step}: '
        + ' | '.join(shown)
        + f' ({self.num_batches} held-out batches, {time.time() - start:.1f}s)',
        flush=True,
      )
    return row
