"""How many masked tokens each decoding step of a block commits: the reverse process's schedule.

'linear' (LLaDA's get_num_transfer_tokens): the block's masked count n, fixed at the block's
start, split evenly over its steps, n // steps each and the remainder to the first steps.
'dream' (Dream's diffusion_generate): times t_i on linspace(1, eps, steps + 1); step i commits
floor(m_i (1 - t_{i+1} / t_i)) of the m_i tokens still masked when it runs, and the last step all
that remain (reference/families_and_decoding.md 2.6). 'auto' is Dream's for Dream-family models
(model.shift_logits: Dream, DiffuCoder, whose generate is Dream's) and LLaDA's otherwise.
Fast-dLLM's threshold and factor rules commit more on top of either.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import choices


SCHEDULES = choices.SAMPLER_SCHEDULES  # sampler.schedule


def resolve(name: str, model_cfg) -> str:
  """The schedule a decode uses: 'auto' becomes the model family's."""
  if name == 'auto':
    return 'dream' if getattr(model_cfg, 'shift_logits', False) else 'linear'
  return name


def num_transfer_tokens(num_masked_B, steps: int):
  """[B, steps] tokens to commit per step: n // steps each, the remainder to the first steps.

  LLaDA's get_num_transfer_tokens (the linear schedule of the masked-diffusion reverse process).
  """
  base_B1 = num_masked_B[:, None] // steps
  remainder_B1 = num_masked_B[:, None] % steps
  return base_B1 + (jnp.arange(steps)[None] < remainder_B1).astype(base_B1.dtype)


def torch_linspace(start: float, end: float, num: int) -> np.ndarray:
  """float32 linspace computed as torch.linspace computes it on the CPU, so that Dream's schedule
  rounds as Dream's does: a float32 step, each value one fused multiply-add from the nearer end
  (start + step * i for the first half, end - step * (num - 1 - i) for the rest). The float32
  product is exact in float64, so float64 arithmetic rounded once to float32 is that FMA."""
  start_, end_ = np.float32(start), np.float32(end)
  if num == 1:
    return np.array([start_], np.float32)
  step = np.float64(np.float32((end_ - start_) / np.float32(num - 1)))
  index = np.arange(num)
  from_start = np.float64(start_) + step * index
  from_end = np.float64(end_) - step * (num - 1 - index)
  return np.where(index < num // 2, from_start, from_end).astype(np.float32)


def dream_fractions(steps: int, eps: float) -> np.ndarray:
  """float32 [steps]: 1 - t_{i+1} / t_i on Dream's times, in float32 as Dream computes them."""
  t = torch_linspace(1.0, eps, steps + 1)
  return (np.float32(1) - t[1:] / t[:-1]).astype(np.float32)


def counts(name: str, masked_at_start_B, steps: int, eps: float):
  """The per-step count function of one block: step_count(step, masked_now_B) -> int32 [B].

  masked_at_start_B: the block's masked tokens when it starts (the linear schedule splits them);
  masked_now_B: those still masked when the step runs (Dream's schedule takes its share of them).
  """
  if name == 'linear':
    plan_BS = num_transfer_tokens(masked_at_start_B, steps)
    return lambda step, masked_now_B: plan_BS[:, step]
  if name == 'dream':
    fractions_S = jnp.asarray(dream_fractions(steps, eps))

    def step_count(step, masked_now_B):
      share_B = jnp.floor(masked_now_B.astype(jnp.float32) * fractions_S[step]).astype(jnp.int32)
      return jnp.where(step == steps - 1, masked_now_B, share_B)

    return step_count
  raise ValueError(f'unknown schedule {name!r}; known: {SCHEDULES}.')
