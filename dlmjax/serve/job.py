"""A completion request as the serving engine holds it (engine.py schedules Jobs, layout.py lays
their rows out, warmup.py builds stand-ins for the programs they will run)."""

from __future__ import annotations

import dataclasses
import time

from dlmjax.diffusion import sampling_config


def stochastic(settings: sampling_config.SamplingConfig) -> bool:
  """Whether the decode draws random numbers (its text depends on the key)."""
  return settings.temperature > 0 or settings.alg_temp > 0 or settings.remasking == 'random'


@dataclasses.dataclass(eq=False)
class Job:
  """One completion: its prompt ids, settings (gen_length = max_tokens), and the decode so far.

  The engine calls on_update(job) from its thread after every chunk (and once when the job
  ends); `tokens` then holds every committed token, `finish_reason` is set when it ended.
  """

  prompt: list
  settings: sampling_config.SamplingConfig
  seed: int | None = None
  stop: tuple = ()
  on_update: object = None
  tokens: list = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # 'stop' | 'length' | 'cancelled' | 'error'
  error: str | None = None
  text: str = ''
  chunks: int = 0
  inflight: int = 0  # blocks dispatched whose tokens are not taken yet
  cancelled: bool = False
  created: float = dataclasses.field(default_factory=time.monotonic)
