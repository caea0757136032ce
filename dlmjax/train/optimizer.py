"""AdamW with MegaDLMs' learning-rate schedules, and no weight decay on norms (1-D per layer)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from dlmjax.parallel import rules
from dlmjax.train import choices

# AdamW's beta1 and epsilon: every recipe and peer here uses these (Megatron's defaults); b2 is
# train.b2.
ADAM_B1, ADAM_EPS = 0.9, 1e-8
WSD_STYLES = choices.WSD_STYLES  # train.schedule's warmup-stable-decay shapes
SCHEDULES = choices.SCHEDULES  # train.schedule


def _anneal(progress, style):
  """Coefficient going 1 -> 0 over progress 0 -> 1 (Megatron's WSD decay styles)."""
  if style == 'exponential':
    return 2.0 * 0.5**progress - 1.0
  if style == 'linear':
    return 1.0 - progress
  if style == 'cosine':
    return 0.5 * (jnp.cos(math.pi * progress) + 1.0)
  raise ValueError(f'unknown decay style {style!r}')


def learning_rate_schedule(train_config):
  """lr(update index k). As Megatron counts samples from 0, the first update uses lr = 0 when
  warming up, and the warmup reaches the peak at update `warmup_steps`."""
  t = train_config
  peak, floor, warmup, total = t.lr, t.min_lr, t.warmup_steps, t.steps

  def schedule(count):
    s = jnp.asarray(count, jnp.float32)
    warm = peak * s / max(warmup, 1)
    if t.schedule == 'constant':
      after = jnp.asarray(peak, jnp.float32)
    elif t.schedule in WSD_STYLES:
      decay = t.wsd_decay_steps
      progress = jnp.clip((s - (total - decay)) / max(decay, 1), 0.0, 1.0)
      annealed = floor + _anneal(progress, WSD_STYLES[t.schedule]) * (peak - floor)
      after = jnp.where(s <= total - decay, peak, annealed)
      after = jnp.where(s > total, floor, after)
    else:  # cosine over decay_steps after warmup (Megatron's cosine style), then min_lr.
      span = t.decay_steps or (total - warmup)
      progress = jnp.clip((s - warmup) / max(span, 1), 0.0, 1.0)
      after = floor + _anneal(progress, 'cosine') * (peak - floor)
    return jnp.where((warmup > 0) & (s <= warmup), warm, after)

  return schedule


def weight_decay_mask(axes_tree):
  """Decay every matrix; never norms (MegaDLMs skips all 1-D params, the q/k norms included)."""
  return jax.tree.map(
    lambda axes: rules.NORM not in axes, axes_tree, is_leaf=lambda x: isinstance(x, tuple)
  )


def make_optimizer(train_config, axes_tree) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW. The gradient norm is logged by the step before clipping."""
  t = train_config
  return optax.chain(
    optax.clip_by_global_norm(t.clip_grad_norm) if t.clip_grad_norm > 0 else optax.identity(),
    optax.adamw(
      learning_rate_schedule(t),
      b1=ADAM_B1,
      b2=t.b2,
      eps=ADAM_EPS,
      weight_decay=t.weight_decay,
      mask=weight_decay_mask(axes_tree),
    ),
  )
