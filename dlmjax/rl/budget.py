"""How VRPO spends its budget of masked forwards per ELBO estimate (preference.budget,
preference.n_time): jax-free, so the preference stage's config check uses it before jax loads."""

from __future__ import annotations

from dlmjax.config import ConfigError


def allocation(budget: int, n_time: int) -> tuple[int, int]:
  """(n_time, n_mask) spending `budget` masked forwards per ELBO: n_time 0 is the optimal
  allocation (budget, 1); otherwise n_time timesteps with budget / n_time masks each."""
  if n_time == 0:
    return budget, 1
  if n_time < 1 or budget % n_time:
    raise ConfigError(
      f'preference.budget={budget} is not a multiple of preference.n_time={n_time}; set n_time '
      'to a divisor of the budget, or 0 (the optimal allocation).'
    )
  return n_time, budget // n_time
