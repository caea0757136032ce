"""The per-step commit counts (diffusion/schedules.py) against Dream's own arithmetic in torch:
times on torch.linspace(1, eps, steps + 1) in float32, int(m * (1 - s / t)) of the m still
masked, every remaining token at the last step."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlmjax.diffusion import schedules


@pytest.mark.parametrize('eps', [1e-3, 1e-2, 0.3])
def test_times_are_torch_linspace_bit_for_bit(eps):
  for steps in range(1, 300):
    want = torch.linspace(1, eps, steps + 1).numpy()
    np.testing.assert_array_equal(schedules.torch_linspace(1.0, eps, steps + 1), want)


def _dream_counts(masked: int, steps: int, eps: float) -> list[int]:
  """Dream's diffusion_generate count per step for one row, the masks taken as it goes."""
  timesteps = torch.linspace(1, eps, steps + 1)
  counts = []
  for i in range(steps):
    num_mask_token = torch.tensor(masked) / 1  # Dream: mask_index.sum() / batch (float32)
    t, s = timesteps[i], timesteps[i + 1]
    n = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
    counts.append(n)
    masked -= n
  return counts


@pytest.mark.parametrize('steps,eps', [(8, 1e-3), (32, 1e-3), (5, 0.05), (64, 1e-3)])
def test_dream_counts_are_dreams(steps, eps):
  masked_B = jnp.array([1, 7, 16, 32, 64, 100, 256])
  step_count = schedules.counts('dream', masked_B, steps, eps)
  left_B, got = masked_B, []
  for step in range(steps):
    n_B = step_count(step, left_B)
    got.append(np.asarray(n_B))
    left_B = left_B - n_B
  want = [_dream_counts(int(m), steps, eps) for m in masked_B]
  np.testing.assert_array_equal(np.stack(got, 1), np.array(want))
  assert (np.asarray(left_B) == 0).all()


def test_linear_counts_split_the_block_start_count():
  step_count = schedules.counts('linear', jnp.array([7, 8]), 3, 1e-3)
  np.testing.assert_array_equal([step_count(s, None) for s in range(3)], [[3, 3], [2, 3], [2, 2]])


def test_auto_is_the_familys():
  class Cfg:
    shift_logits = True

  assert schedules.resolve('auto', Cfg) == 'dream'
  Cfg.shift_logits = False
  assert schedules.resolve('auto', Cfg) == 'linear'
  assert schedules.resolve('dream', Cfg) == 'dream'
