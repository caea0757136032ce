"""The reward model's score head (ModelConfig.score_head): a linear map [D, 1] from the final
hidden state to a scalar, in place of the output head, as transformers' *ForSequenceClassification
holds it (`score.weight` [1, D]); Transformer.scores pools it the way those classes do.

A reward run starts from a language model without one: the head is drawn fresh, N(0, init_std)
as transformers initialises `score` (initializer_range), from the run's seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KEY = 'score'
_STREAM = 0x5C0E  # keeps the head's draw apart from the other seeded streams


def fresh(seed: int, d_model: int, std: float):
  """A new head [D, 1], float32."""
  key = jax.random.fold_in(jax.random.key(seed), _STREAM)
  return std * jax.random.normal(key, (d_model, 1), jnp.float32)


def attach(params: dict, cfg, seed: int) -> dict:
  """A language model's params as the reward model `cfg` (score_head): the output head dropped
  (the embedding stays, tied or not), a fresh score head added."""
  out = {k: v for k, v in params.items() if k != 'lm_head'}
  out[KEY] = fresh(seed, cfg.d_model, cfg.init_std)
  return out
