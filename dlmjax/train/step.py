"""The one train step every stage shares: accumulate gradients over micro-batches, clip, AdamW.

Stages differ only in the loss function they plug in. The step is pure and jitted once with
explicit shardings; the state is donated, and no value leaves the device inside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.parallel import rules
from dlmjax.train import optimizer as optimizer_lib


def microbatch_split(x, num_micro: int):
  """[G, ...] -> [num_micro, G/num_micro, ...], micro-batch i = rows {j*num_micro + i}.

  Strided, so that each micro-batch spans every batch-parallel device without moving data.
  """
  per_micro = x.shape[0] // num_micro
  return jnp.swapaxes(x.reshape(per_micro, num_micro, *x.shape[1:]), 0, 1)


def batch_keys(config) -> tuple[str, ...]:
  """The arrays of a batch, each [global_batch_size, seq_len + 1] int32."""
  return ('tokens', 'segment_ids') if config.data.packing else ('tokens',)


def make_step_fn(setup, loss_fn):
  """step(state, batch) -> (state, metrics); loss_fn(apply_fn, tokens, **randomness, **fields)
  as in dlmjax.diffusion.loss, where fields are the batch's other arrays (segment_ids)."""
  config, cfg = setup.config, setup.model_config
  num_micro = config_lib.num_microbatches(config)
  schedule = optimizer_lib.learning_rate_schedule(config.train)
  loss_kwargs = dict(seed=config.seed, mask_id=config.model.mask_token_id,
                     varlen_prob=config.diffusion.varlen_prob)
  batch_axes = (rules.BATCH, None)

  def micro_step(params, step, tokens, fields, example_ids, micro_index):
    def objective(p):
      module = model_lib.merge(cfg, p)
      return loss_fn(module, tokens, step=step, micro_index=micro_index,
                     example_ids_B=example_ids, **fields, **loss_kwargs)

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return grads, sums

  def step_fn(state, batch):
    params, step = state['params'], state['step']
    tokens = batch['tokens']
    example_ids = step * tokens.shape[0] + jnp.arange(tokens.shape[0])
    micro_tokens = rules.constrain(microbatch_split(tokens, num_micro), (None, *batch_axes))
    # Other per-row arrays (segment_ids) are split and laid out like the tokens.
    micro_fields = {k: rules.constrain(microbatch_split(v, num_micro), (None, *batch_axes))
                    for k, v in batch.items() if k != 'tokens'}
    micro_ids = microbatch_split(example_ids, num_micro)

    def accumulate(carry, xs):
      grads_acc, sums_acc = carry
      tokens_mb, fields_mb, ids_mb, index = xs
      fields_mb = {k: rules.constrain(v, batch_axes) for k, v in fields_mb.items()}
      grads, sums = micro_step(params, step, rules.constrain(tokens_mb, batch_axes), fields_mb,
                               ids_mb, index)
      grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
      sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
      return (grads_acc, sums_acc), None

    zero_grads = jax.tree.map(jnp.zeros_like, params)
    _, zero_sums = jax.eval_shape(
        lambda: micro_step(params, step, micro_tokens[0],
                           {k: v[0] for k, v in micro_fields.items()}, micro_ids[0], 0))
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_sums)
    (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums),
                                    (micro_tokens, micro_fields, micro_ids,
                                     jnp.arange(num_micro)))
    # MegaDLMs back-propagates num/den per micro-batch divided by the micro-batch count.
    grads = jax.tree.map(lambda g: g / num_micro, grads)
    grad_norm = optax.global_norm(grads)
    updates, opt_state = setup.optimizer.update(grads, state['opt_state'], params)
    # A non-finite loss or gradient skips the update: params and optimizer state (and with it the
    # schedule's count, as Megatron's skipped iterations) stay as they were; the data moves on.
    finite = jnp.isfinite(sums['loss_num']) & jnp.isfinite(grad_norm)

    def keep(new, old):
      return jnp.where(finite, new, old)

    new_state = dict(step=step + 1,
                     params=jax.tree.map(keep, optax.apply_updates(params, updates), params),
                     opt_state=jax.tree.map(keep, opt_state, state['opt_state']))
    metrics = dict(
        skipped=1.0 - finite.astype(jnp.float32),
        loss=sums['loss_num'] / sums['loss_den'],
        masked_ce=sums['masked_ce_sum'] / jnp.maximum(sums['masked_count'], 1.0),
        mask_ratio=sums['mask_ratio_sum'] / sums['rows'],
        real_input_length=sums['length_sum'] / sums['micro_batches'],
        tokens=sums['loss_den'],
        grad_norm=grad_norm,
        lr=schedule(step),
    )
    return new_state, metrics

  return step_fn


class CompiledStep:
  """The step jitted once for the mesh, with donated state and explicit shardings."""

  def __init__(self, setup, loss_fn):
    self.setup = setup
    self.batch_sharding = rules.named_sharding(setup.mesh, (rules.BATCH, None))
    self._jitted = jax.jit(
        make_step_fn(setup, loss_fn),
        in_shardings=(setup.state_shardings,
                      {k: self.batch_sharding for k in batch_keys(setup.config)}),
        out_shardings=(setup.state_shardings, setup.replicated),
        donate_argnums=0)

  def __call__(self, state, batch):
    with rules.activation_mesh(self.setup.mesh):
      return self._jitted(state, batch)

  def lower(self, batch_shapes):
    """Lowered for the abstract state (summary uses this to report memory without running)."""
    with rules.activation_mesh(self.setup.mesh):
      return self._jitted.lower(self.setup.state_shapes, batch_shapes)
