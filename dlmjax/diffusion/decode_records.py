"""What a decode records besides its tokens, declared by the caller (RL objectives ask for them).

Each record keeps a buffer the decoding loop carries: `init` makes it, `update` folds in one
step (a StepView: the canvas before and after the step's commits, the block's predictions x0 it
committed from, the step's forward), `output` gives it back in the caller's layout ([B, ...,
gen_length]: the completion's positions). 'steps': the step that committed each token (TraceRL's
trajectory, rl/estimators.py trace_token_logprobs). 'predictions': x_0|l at every step (wd1++'s
stepwise targets). A new record is one class here and its entry in RECORDS.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from dlmjax.diffusion import canvas as canvas_lib


class StepView(typing.NamedTuple):
  """One decoding step as the records see it."""

  canvas: object
  x_before: jax.Array  # [B, length]: the canvas the step ran on.
  x_after: jax.Array  # [B, length]: with the step's commits.
  x0_BK: jax.Array  # [B, block]: the block's predictions the commits were taken from.
  block_index: jax.Array
  global_step: jax.Array  # block_index * steps_per_block + the step in the block.
  start: jax.Array  # the block's first canvas position.
  forward: object  # cache_modes.base.Forward of the step.


class Record:
  name = ''

  def check(self, model_cfg, sampling, mode) -> None:
    """Raises ValueError naming the setting to change where this record cannot be kept."""

  def init(self, canvas):
    raise NotImplementedError

  def update(self, buffer, view: StepView):
    raise NotImplementedError

  def output(self, buffer, canvas, gather_BG):
    raise NotImplementedError


class CommitSteps(Record):
  """int32 [B, gen_length]: the step (over the whole decode) that committed each token, -1 if
  none did. Only the block can change in a step, so only its window is written."""

  name = 'steps'

  def init(self, canvas):
    return jnp.full((canvas.batch, canvas.length), -1, jnp.int32)

  def update(self, steps_BL, view):
    c, start = view.canvas, view.start
    before_BK, after_BK = c.window(view.x_before, start), c.window(view.x_after, start)
    committed_BK = (before_BK == c.mask_id) & (after_BK != c.mask_id)
    steps_BK = jnp.where(committed_BK, view.global_step, c.window(steps_BL, start))
    return jax.lax.dynamic_update_slice_in_dim(steps_BL, steps_BK, start, axis=1)

  def output(self, steps_BL, canvas, gather_BG):
    return jnp.take_along_axis(steps_BL, gather_BG, axis=1)


class StepPredictions(Record):
  """int32 [B, steps, gen_length]: x_0|l, the clean completion predicted at each step l from the
  state before it: committed tokens kept, every still-masked token filled with the prediction:
  in the current block the x0 the step commits from, after it the argmax of the same forward's
  logits (CFG and the forbidden tokens as in the block). Needs the whole canvas's forward every
  step ('none') and every row to run every step."""

  name = 'predictions'

  def check(self, model_cfg, sampling, mode):
    if mode.name != 'none' or canvas_lib.block_grid(model_cfg) > 1:
      raise ValueError(
        "per-step predictions (wd1++) need cache='none' and a non-block-causal model (this "
        f'is cache={sampling.cache!r}, {model_cfg.attention_mask}): set sampler.cache=none.'
      )
    if (
      sampling.threshold > 0
      or sampling.factor > 0
      or sampling.stop_at_eos
      or sampling.edit_threshold > 0
      or sampling.steps_per_block > sampling.block_length
    ):
      raise ValueError(
        'per-step predictions (wd1++) need every step to commit a token: set threshold=0, '
        f'factor=0, stop_at_eos=False, edit_threshold=0 and steps_per_block '
        f'({sampling.steps_per_block}) <= '
        f'block_length ({sampling.block_length}).'
      )

  def init(self, canvas):
    total = canvas.num_blocks * canvas.sampling.steps_per_block
    return jnp.full((total, canvas.batch, canvas.length), canvas.mask_id, jnp.int32)

  def update(self, preds_SBL, view):
    c = view.canvas
    hidden, start = view.forward.hidden, view.start
    x0_BL = jax.lax.dynamic_update_slice_in_dim(view.x_before, view.x0_BK, start, axis=1)

    # Only the blocks after this one still hold masks to predict (every step commits, so the
    # earlier ones are complete): their argmax, one block at a time.
    def later_block(b, x0_BL):
      s = c.block_start(b)
      argmax_BK = jnp.argmax(c.predictable(c.guided(hidden, s)), -1).astype(jnp.int32)
      return jax.lax.dynamic_update_slice_in_dim(x0_BL, argmax_BK, s, axis=1)

    x0_BL = jax.lax.fori_loop(view.block_index + 1, c.num_blocks, later_block, x0_BL)
    masked_BL = (view.x_before == c.mask_id) & c.decodable_BL
    predicted_BL = jnp.where(masked_BL, x0_BL, view.x_before)
    return jax.lax.dynamic_update_index_in_dim(preds_SBL, predicted_BL, view.global_step, axis=0)

  def output(self, preds_SBL, canvas, gather_BG):
    preds_BSL = jnp.moveaxis(preds_SBL, 0, 1)
    return jnp.take_along_axis(preds_BSL, gather_BG[:, None], axis=2)


RECORDS: dict[str, Record] = {r.name: r for r in (CommitSteps(), StepPredictions())}


def get(names) -> tuple[Record, ...]:
  """The records called names, in that order; an unknown name fails naming the known ones."""
  unknown = [n for n in names if n not in RECORDS]
  if unknown:
    raise ValueError(f'unknown decode records {unknown}; known: {tuple(RECORDS)}.')
  return tuple(RECORDS[n] for n in names)
