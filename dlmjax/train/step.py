"""The one train step every stage shares: accumulate gradients over micro-batches, clip, AdamW.

Stages differ only in what they plug in (a dlmjax.train.stages.base.Stage): the loss, the batch's
arrays and the metrics made of the loss's sums. The gradient is the SUM over micro-batches of each
micro-batch objective's gradient: every stage's loss is written to that rule (stages/base.py).
The step is pure and jitted once with explicit shardings; the state is donated, and no value
leaves the device inside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.model import lora, moe, moe_stats, programs
from dlmjax.parallel import rules
from dlmjax.train import optimizer as optimizer_lib


def microbatch_split(x, num_micro: int):
  """[G, ...] -> [num_micro, G/num_micro, ...], micro-batch i = rows {j*num_micro + i}.

  Strided, so that each micro-batch spans every batch-parallel device without moving data.
  """
  per_micro = x.shape[0] // num_micro
  return jnp.swapaxes(x.reshape(per_micro, num_micro, *x.shape[1:]), 0, 1)


def _row_axes(ndim: int, leading=()):
  """Logical axes of a batch array: rows over the batch-parallel devices, the rest replicated."""
  return (*leading, rules.BATCH) + (None,) * (ndim - 1)


def make_step_fn(setup, stage):
  """step(state, batch, frozen) -> (state, metrics) of a stage (stages/base.py Stage); frozen is
  a LoRA run's base (setup.frozen, an empty dict otherwise), which gets no gradient.

  stage.loss(module, *, step, micro_index, example_ids_B, **arrays) -> (objective, sums) gets one
  micro-batch of every batch array ([rows, ...], e.g. tokens=, segment_ids=) and the indices its
  randomness derives from; stage.metrics(sums) -> {name: scalar} (with at least `loss` and
  `tokens`) turns the sums accumulated over micro-batches into the step's metrics. The stage's
  router-loss policy and its carried state (updated after the optimizer's) come from the Stage.
  """
  loss_fn, metrics_fn, carried = stage.loss, stage.metrics, stage.carried
  config, cfg = setup.config, setup.model_config
  num_micro = config_lib.num_microbatches(config)
  schedule = optimizer_lib.learning_rate_schedule(config.train)
  experts = config.model.moe
  # The MoE router losses (model/moe_stats.py) join the objective where the stage says so.
  router_weight = dict(balance_loss=experts.balance_loss, z_loss=experts.z_loss)
  if not stage.router_losses:
    router_weight = dict(balance_loss=0.0, z_loss=0.0)

  dropout = config.train.lora.dropout if setup.lora else 0.0

  def micro_step(params, frozen, step, arrays, example_ids, micro_index):
    def objective(p):
      module = model_lib.merge(cfg, lora.combine(p, frozen) if setup.lora else p)
      # Adapter dropout in the train step's forward only (docs/lora.md, What is trained).
      with lora.dropout(lora.dropout_key(config.seed, step, micro_index), dropout):
        with moe_stats.collect() as calls:
          value, sums = loss_fn(
            module, step=step, micro_index=micro_index, example_ids_B=example_ids, **arrays
          )
      if calls:  # an MoE: its router losses join the objective, its statistics the sums
        stats = moe_stats.summarize(calls)
        # Each micro-batch's share of the step's mean, as the step's sum rule wants.
        weighted = [w * stats[k] for k, w in router_weight.items() if w]
        stats['router_loss'] = sum(weighted, jnp.zeros((), jnp.float32))
        value = value + stats['router_loss'] / num_micro
        sums = dict(sums, **{moe_stats.SUM_PREFIX + k: v for k, v in stats.items()})
      return value, sums

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return grads, sums

  def step_fn(state, batch, frozen):
    params, step = state['params'], state['step']
    rows = next(iter(batch.values())).shape[0]
    example_ids = step * rows + jnp.arange(rows)
    # Every per-row array is split into micro-batches and laid out the same way.
    micro_arrays = {
      k: rules.constrain(microbatch_split(v, num_micro), _row_axes(v.ndim, (None,)))
      for k, v in batch.items()
    }
    micro_ids = microbatch_split(example_ids, num_micro)

    def accumulate(carry, xs):
      grads_acc, sums_acc = carry
      arrays_mb, ids_mb, index = xs
      arrays_mb = {k: rules.constrain(v, _row_axes(v.ndim)) for k, v in arrays_mb.items()}
      grads, sums = micro_step(params, frozen, step, arrays_mb, ids_mb, index)
      grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
      sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
      return (grads_acc, sums_acc), None

    zero_grads = jax.tree.map(jnp.zeros_like, params)
    _, zero_sums = jax.eval_shape(
      lambda: micro_step(
        params, frozen, step, {k: v[0] for k, v in micro_arrays.items()}, micro_ids[0], 0
      )
    )
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_sums)
    (grads, sums), _ = jax.lax.scan(
      accumulate, (zero_grads, zero_sums), (micro_arrays, micro_ids, jnp.arange(num_micro))
    )
    grad_norm = optax.global_norm(grads)
    updates, opt_state = setup.optimizer.update(grads, state['opt_state'], params)
    # A non-finite loss or gradient skips the update: params and optimizer state (and with it the
    # schedule's count, as Megatron's skipped iterations) stay as they were; the data moves on.
    metrics = dict(metrics_fn(sums))
    new_params = optax.apply_updates(params, updates)
    if moe_stats.SUM_PREFIX + 'counts' in sums:
      metrics.update(moe_stats.metrics(sums, num_micro))
      if stage.loss_is_objective:  # the router losses' part of the objective too
        metrics['loss'] = metrics['loss'] + metrics[moe_stats.SUM_PREFIX + 'router_loss']
      # Loss-free balancing: the sigmoid router's bias takes its sign update, not optax's.
      new_params = moe.balance_bias(
        new_params, sums[moe_stats.SUM_PREFIX + 'counts'], experts.bias_rate, old=params
      )
    finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(grad_norm)

    def keep(new, old):
      return jnp.where(finite, new, old)

    new_state = dict(
      step=step + 1,
      params=jax.tree.map(keep, new_params, params),
      opt_state=jax.tree.map(keep, opt_state, state['opt_state']),
    )
    if carried is not None:  # the stage's own state (RL's refreshed KL reference)
      new_state[carried.key] = carried.update(step + 1, state[carried.key], new_state['params'])
    metrics.update(skipped=1.0 - finite.astype(jnp.float32), grad_norm=grad_norm, lr=schedule(step))
    return new_state, metrics

  return step_fn


class CompiledStep:
  """The step of `stage` jitted once for the mesh, with donated state and explicit shardings:
  the one way the loop, bench, summary and the profiler build it.

  Every batch array is split by rows over the batch-parallel devices, whatever its rank.
  """

  def __init__(self, setup, stage):
    self.setup, self.stage = setup, stage
    self.batch_sharding = rules.named_sharding(setup.mesh, (rules.BATCH,))
    self._jitted = programs.jit_program(
      make_step_fn(setup, stage),
      setup.model_config.matmul_dtype,
      in_shardings=(
        setup.state_shardings,
        {k: self.batch_sharding for k in stage.batch_keys},
        setup.frozen_shardings,
      ),
      out_shardings=(setup.state_shardings, setup.replicated),
      donate_argnums=0,
    )

  def __call__(self, state, batch):
    with rules.activation_mesh(self.setup.mesh):
      return self._jitted(state, batch, self.setup.frozen)

  def compile(self, state, batch):
    """Compiles for these arguments without running; the next call reuses the executable (a
    multi-process run lines its processes up in between, see train/loop.py). Returns it: its
    HLO names the kernels a profile of the run shows (scripts/profile_step.py)."""
    with rules.activation_mesh(self.setup.mesh):
      return self._jitted.lower(state, batch, self.setup.frozen).compile()

  def lower(self, batch_shapes):
    """Lowered for the abstract state (summary uses this to report memory without running)."""
    with rules.activation_mesh(self.setup.mesh):
      return self._jitted.lower(self.setup.state_shapes, batch_shapes, self.setup.frozen_shapes)
