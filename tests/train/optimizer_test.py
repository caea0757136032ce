"""Schedules against MegaDLMs' formula, and weight decay only on matrices."""

import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.train import optimizer


def _train(**kw):
  t = config_lib.defaults().train
  t.update({**dict(lr=1.0, min_lr=0.1, steps=100, warmup_steps=10, wsd_decay_steps=20), **kw})
  return t


def test_wsd_exponential_matches_megatron():
  lr = optimizer.learning_rate_schedule(_train(schedule='wsd'))  # exponential
  assert float(lr(0)) == 0.0  # Megatron's first update uses lr 0
  np.testing.assert_allclose(float(lr(5)), 0.5)
  np.testing.assert_allclose(float(lr(10)), 1.0)
  np.testing.assert_allclose(float(lr(80)), 1.0)  # stable until steps - decay
  for r, coeff in ((0.25, 0.682), (0.5, 0.414), (0.75, 0.189)):  # reference 2.2 sample values
    np.testing.assert_allclose(float(lr(80 + 20 * r)), 0.1 + coeff * 0.9, atol=1e-3)
  np.testing.assert_allclose(float(lr(100)), 0.1, atol=1e-6)
  np.testing.assert_allclose(float(lr(150)), 0.1, atol=1e-6)


@pytest.mark.parametrize('schedule,mid', [('wsd_linear', 0.55), ('wsd_cosine', 0.55)])
def test_wsd_other_styles(schedule, mid):
  lr = optimizer.learning_rate_schedule(_train(schedule=schedule))
  np.testing.assert_allclose(float(lr(90)), mid, atol=1e-6)


def test_cosine_and_constant():
  lr = optimizer.learning_rate_schedule(_train(schedule='cosine'))
  np.testing.assert_allclose(float(lr(55)), 0.1 + 0.5 * 0.9, atol=1e-6)
  np.testing.assert_allclose(float(lr(100)), 0.1, atol=1e-6)
  lr = optimizer.learning_rate_schedule(_train(schedule='constant'))
  np.testing.assert_allclose([float(lr(s)) for s in (5, 50, 99)], [0.5, 1.0, 1.0])


def test_no_weight_decay_on_norms():
  axes = {'w': ('layers', 'embed', 'mlp'), 'norm': {'scale': ('layers', 'norm')}}
  assert optimizer.weight_decay_mask(axes) == {'w': True, 'norm': {'scale': False}}
  tx = optimizer.make_optimizer(
    _train(schedule='constant', warmup_steps=0, weight_decay=0.5, clip_grad_norm=0.0), axes
  )
  params = {'w': jnp.ones((1, 2, 2)), 'norm': {'scale': jnp.ones((1, 2))}}
  zero = {'w': jnp.zeros((1, 2, 2)), 'norm': {'scale': jnp.zeros((1, 2))}}
  updates, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], -0.5)  # lr 1 x wd 0.5 x w
  np.testing.assert_allclose(updates['norm']['scale'], 0.0)
