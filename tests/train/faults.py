"""Fault injection for the step and loop tests."""

import jax.numpy as jnp


def nan_on(steps, base_loss):
  """The stage's loss, made non-finite on the given steps (fault injection)."""

  def fn(module, tokens, *, step, **kwargs):
    objective, sums = base_loss(module, tokens, step=step, **kwargs)
    bad = jnp.where(jnp.isin(step, jnp.asarray(steps)), jnp.nan, 1.0)
    return objective * bad, dict(sums, loss_num=sums['loss_num'] * bad)

  return fn
