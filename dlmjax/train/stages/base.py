"""The Stage: everything a stage plugs into the shared step and loop, declared in one place.

A stage is a loss, a batch source, the batch's arrays, the metrics made of the loss's sums, an
evaluator, how the console treats its loss, the input files it checks, the MoE router-loss policy,
the extra state it carries in the train state and the device memory it holds beside it. The step,
the loop, the train state, evaluation, the guards, the memory estimate and the reporter read these
fields and never ask which stage runs.

The step's rule for micro-batches, which every stage's loss is written to: the step's gradient
is the SUM over micro-batches of the gradient of each micro-batch's `objective`. A loss whose
natural form is a mean over micro-batches (MegaDLMs' per-micro-batch num / den) divides by the
micro-batch count itself; one that weights each unit by its share of the global batch (RL)
returns that weighted sum as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

Batch = dict[str, np.ndarray]
Row = dict[str, float]


class BatchSource(Protocol):
  """Where a stage's batches come from: this process's rows of each global batch.

  `next(params)` gets the live params of the step about to run (RL samples its rollouts from
  them; data readers ignore them) and returns the batch and a metrics row for the loop's reporter
  to write (None when the source has nothing to log). Its state is checkpointed with the run.
  """

  def next(self, params) -> tuple[Batch, Row | None]: ...

  def get_state(self) -> dict: ...

  def set_state(self, state: dict) -> None: ...


class Evaluator(Protocol):
  """A held-out evaluation, run every eval.every steps: `run` returns the row to log (with its
  `step`) and prints one line."""

  def run(self, step: int, params) -> Row: ...


class DataBatches:
  """A BatchSource over a data iterator (grain-style get_state / set_state): the params are not
  needed to read data."""

  def __init__(self, iterator: Iterator[Batch]):
    self.iterator = iterator

  def next(self, params) -> tuple[Batch, None]:
    del params
    return next(self.iterator), None

  def get_state(self) -> dict:
    return self.iterator.get_state()

  def set_state(self, state: dict) -> None:
    self.iterator.set_state(state)


@dataclasses.dataclass(frozen=True)
class CarriedState:
  """State a stage carries in the train state beside step, params and opt_state, checkpointed and
  resumed with them (RL's refreshed KL reference).

  key: its name in the train state.
  init(params) -> value: its value at step 0, from the trainable params (traced; the shapes
    follow from it).
  update(new_step, value, new_params) -> value: inside the step, after the optimizer update
    (new_step 1-based, traced).
  hand_over(batches, value): the loop gives the current value to the stage's BatchSource before
    each batch (RL scores its rollouts with it).
  """

  key: str
  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any], Any]
  hand_over: Callable[[Any, Any], None]


def _no_inputs() -> None:
  """A stage that reads no files of its own."""


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage, built from the run's config by `dlmjax.train.stages.build`.

  loss(module, *, step, micro_index, example_ids_B, **arrays) -> (objective, sums): one
    micro-batch of every batch array and the indices its randomness derives from; `objective`
    follows the micro-batch rule above, `sums` are added over micro-batches.
  batch_keys: the batch's arrays, each [global_batch_size, ...]; 'tokens' (model token ids,
    checked against the vocabulary every step) is always one of them.
  metrics(sums) -> {name: scalar}: the step's metrics, with at least `loss` and `tokens`.
  batches(setup, process_index, process_count) -> BatchSource.
  evaluator(setup) -> Evaluator: the held-out evaluation eval.every runs.
  example_batch(rng) -> Batch: a whole global batch of these arrays with real shapes, dtypes and
    plausible values, for benchmarks, profiles and the compiled memory report.
  console_metrics: metrics the console line shows after the loss.
  data_keys: the config keys that decide which samples the batch source's position counts in
    (data_fingerprint.py: a resume on other data is refused unless data.new_phase).
  flag_spikes: apply MegaDLMs' 20% loss-spike rule (meaningful for a language-modelling loss; an
    RL surrogate near zero changes sign, SFT's moves with each batch's answer lengths).
  check_inputs() -> None: fails in a second, before any model is built, when a file the stage
    reads is missing (a DataError naming the path and the key to fix).
  router_losses: an MoE's router losses (model.moe.balance_loss, model.moe.z_loss) join the
    objective.
  loss_is_objective: the logged `loss` is the whole objective, the router losses' part included
    (RL: its surrogate means nothing alone); otherwise the language-modelling loss alone.
  carried: the extra state the train state holds for the stage, or None.
  resident_param_bytes: bytes per parameter the stage keeps on every device beside the train
    state, sharded like the params (RL's KL reference on the mesh), for the memory estimate.
  """

  name: str
  loss: Callable[..., tuple[Any, dict]]
  batch_keys: tuple[str, ...]
  metrics: Callable[[dict], dict]
  batches: Callable[[Any, int, int], BatchSource]
  evaluator: Callable[[Any], Evaluator]
  example_batch: Callable[[np.random.Generator], Batch]
  console_metrics: tuple[str, ...] = ()
  flag_spikes: bool = False
  check_inputs: Callable[[], None] = _no_inputs
  router_losses: bool = True
  loss_is_objective: bool = False
  carried: CarriedState | None = None
  resident_param_bytes: float = 0.0
  data_keys: tuple[str, ...] = ('seed',)

  def __post_init__(self):
    if 'tokens' not in self.batch_keys:
      raise ValueError(f'stage {self.name}: batch_keys {self.batch_keys} lack "tokens".')


def random_tokens(config, rng: np.random.Generator, shape) -> np.ndarray:
  """Random token ids below the mask id, so none is a mask token (data for benchmarks)."""
  return rng.integers(0, config.model.mask_token_id, size=shape, dtype=np.int32)
