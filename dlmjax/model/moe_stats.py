"""The mixture-of-experts layer's router statistics (model/moe.py), and their collection over the
forward passes of a traced loss into the train step's losses and metrics.

Every layer reports router statistics: per-expert assignment counts, the load-balancing loss
(Switch / transformers' load_balancing_loss_func: E x sum_e f_e P_e, f_e the share of assignments
to e times k, P_e the mean router probability; k at perfect balance), the router z-loss (ST-MoE:
mean logsumexp(logits)^2) and the router's mean entropy. A layer returns them as additive sums
(`layer_sums`), and `layer_stats` forms them from the sums of one forward: a forward split into
pipeline micro-batches adds its pieces' sums first, so it reports what the whole batch would
(docs/moe.md, pipeline stages). The transformer hands them to `collect` (the train step adds the
losses it is configured with).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp


def layer_sums(logits_BLE, probs_BLE, experts_BLK) -> dict:
  """One layer's router statistics over its tokens as additive sums: per-expert assignment counts
  and summed probabilities, the token count, and the summed squared logsumexp and entropy. Sums
  over any split of the tokens (the pipeline's micro-batches) add up to those of the whole;
  `layer_stats` forms the losses from them (docs/moe.md, pipeline stages)."""
  num_experts = logits_BLE.shape[-1]
  counts_E = jnp.sum(jax.nn.one_hot(experts_BLK, num_experts, dtype=jnp.float32), axis=(0, 1, 2))
  entropy_BL = -jnp.sum(probs_BLE * jnp.log(jnp.maximum(probs_BLE, 1e-30)), -1)
  return dict(
    counts=counts_E,
    probs=jnp.sum(probs_BLE, axis=(0, 1)),
    tokens=jnp.asarray(experts_BLK.shape[0] * experts_BLK.shape[1], jnp.float32),
    z_loss=jnp.sum(jnp.square(jax.nn.logsumexp(logits_BLE, axis=-1))),
    entropy=jnp.sum(entropy_BL),
  )


def layer_stats(sums: dict) -> dict:
  """The router statistics the train step reads (module docstring) from `layer_sums`' sums, per
  layer (any leading axes): counts, balance_loss, z_loss and entropy."""
  tokens = sums['tokens']
  num_experts = sums['counts'].shape[-1]
  mean_probs_E = sums['probs'] / tokens[..., None]
  return dict(
    counts=sums['counts'],
    balance_loss=num_experts * jnp.sum(sums['counts'] / tokens[..., None] * mean_probs_E, -1),
    z_loss=sums['z_loss'] / tokens,
    entropy=sums['entropy'] / tokens,
  )


# ----------------------------------------------------------------------------------------------
# Collecting the statistics of every forward pass of a traced loss.

_CALLS: contextvars.ContextVar = contextvars.ContextVar('dlmjax_moe_calls', default=None)


@contextlib.contextmanager
def collect():
  """Within it, every MoE transformer forward appends its layers' statistics (each a dict of
  [layers, ...] arrays) to the yielded list; the train step reads them (train/step.py)."""
  calls: list = []
  token = _CALLS.set(calls)
  try:
    yield calls
  finally:
    _CALLS.reset(token)


def record(stats_per_layer: dict) -> None:
  calls = _CALLS.get()
  if calls is not None:
    calls.append(stats_per_layer)


SUM_PREFIX = 'moe_'  # the statistics' keys among a step's sums


def metrics(sums: dict, num_micro: int) -> dict:
  """The step's router metrics from its summed statistics: the losses and entropy (means over
  layers), router_loss (the weighted router losses the step's objective got), the busiest and
  idlest experts' share of assignments times E (1 = balanced), and every expert's share
  (moe_load_e{j}, over all layers)."""
  counts_E = jnp.sum(sums[SUM_PREFIX + 'counts'], axis=0)
  share_E = counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)
  num_experts = counts_E.shape[0]
  out = {
    SUM_PREFIX + key: sums[SUM_PREFIX + key] / num_micro
    for key in ('balance_loss', 'z_loss', 'entropy', 'router_loss')
    if SUM_PREFIX + key in sums
  }
  out[SUM_PREFIX + 'load_max'] = jnp.max(share_E) * num_experts
  out[SUM_PREFIX + 'load_min'] = jnp.min(share_E) * num_experts
  out.update({f'{SUM_PREFIX}load_e{j}': share_E[j] for j in range(num_experts)})
  return out


def summarize(calls: list) -> dict:
  """The forward passes' statistics as one: counts [layers, E] summed, the rest averaged over
  layers and passes."""
  out = dict(counts=sum(c['counts'] for c in calls))
  for key in ('balance_loss', 'z_loss', 'entropy'):
    out[key] = sum(jnp.mean(c[key]) for c in calls) / len(calls)
  return out
