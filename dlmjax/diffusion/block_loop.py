"""The block decoding loop, shared by every decode: decode_one_block runs one block's steps
(a forward of the cache mode's, then decoding.commit_step), decode_canvas_blocks loops it over
the canvas's blocks. generate's whole completion (sampler.decode_blocks) and the server's calls
(sampler_programs.make_block_fn) both run it, so they decode the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import decode_records, decoding, schedules


def step_keys(key, block, step):
  """(noise key, remasking key) of one decoding step: a function of (key, block, step) only."""
  return jax.random.split(jax.random.fold_in(jax.random.fold_in(key, block), step))


def _finished(canvas, x_BL, eos_id):
  """Rows frozen by stop_at_eos (decoding.finished_rows), or None."""
  if not canvas.sampling.stop_at_eos:
    return None
  return decoding.finished_rows(x_BL, canvas.start_B1[:, 0], mask_id=canvas.mask_id, eos_id=eos_id)


def decode_one_block(
  canvas, block_index, x_BL, state, buffers, start, static_start, *, mode, key, records, eos_id
):
  """(canvas, records' buffers) after the block [start, start + block) is decoded: its
  steps_per_block steps (fewer once nothing is left to commit), each a forward of the cache
  mode's and decoding.commit_step. The one block step of every decode: decode_canvas_blocks
  loops it, for generate's whole completion and for the server's calls (rows that each sit at
  their own block). state is the mode's (init's; refreshing modes refresh their own K/V here)."""
  sampling, mask_id = canvas.sampling, canvas.mask_id
  spb = sampling.steps_per_block
  refresh_every = sampling.cache_refresh or spb
  editing = sampling.edit_threshold > 0  # LLaDA2.1's token-to-token edits (decoding.py)
  schedule = schedules.resolve(sampling.schedule, canvas.module.cfg)
  decodable_BK = canvas.window(canvas.decodable_BL, start)
  left_BK = (canvas.window(x_BL, start) == mask_id) & decodable_BK
  step_count = schedules.counts(schedule, jnp.sum(left_BK, -1), spb, sampling.eps)

  def unfinished(carry):
    step, x, _, post_B = carry
    left_BK = (canvas.window(x, start) == mask_id) & decodable_BK
    done_B = _finished(canvas, x, eos_id)
    if done_B is not None:
      left_BK = left_BK & ~done_B[:, None]
    more = (step < spb) & jnp.any(left_BK)  # with a threshold or factor, a block can end early.
    if editing:  # a row edits on until decoding.edit_done; the masks are gone within spb steps.
      idle_B = post_B > sampling.edit_steps
      idle_B = idle_B if done_B is None else idle_B | done_B
      more = more | ((step < spb + sampling.edit_steps) & ~jnp.all(idle_B))
    return more

  def commit(step, x, buffers, post_B, forward):
    """One step's commits (and edits) from its forward, folded into every record."""
    x_BK = canvas.window(x, start)
    masked_B = jnp.any((x_BK == mask_id) & decodable_BK, -1)
    transfer_B = step_count(step, jnp.sum((x_BK == mask_id) & decodable_BK, -1))
    frozen_B = _finished(canvas, x, eos_id)
    if editing:
      idle_B = post_B > sampling.edit_steps
      frozen_B = idle_B if frozen_B is None else frozen_B | idle_B
    x_blk, x0_blk = decoding.commit_step(
      forward.logits,
      x_BK,
      transfer_B,
      step_keys(key, block_index, step),
      sampling,
      mask_id=mask_id,
      frozen_B=frozen_B,
      decodable_BK=decodable_BK,
      with_x0=True,
    )
    if editing:
      post_B = decoding.edit_count(post_B, masked_B, x_blk != x_BK, sampling.edit_steps)
    new_x = jax.lax.dynamic_update_slice_in_dim(x, x_blk, start, axis=1)
    view = decode_records.StepView(
      canvas, x, new_x, x0_blk, block_index, block_index * spb + step, start, forward
    )
    buffers = tuple(r.update(b, view) for r, b in zip(records, buffers))
    return step + 1, new_x, buffers, post_B

  # post_B: each row's edit steps after its block's masks ran out (sampler.edit_steps + 1 once
  # it stopped editing; decoding.edit_count); unused without sampler.edit_threshold.
  carry = (jnp.int32(0), x_BL, buffers, jnp.zeros(x_BL.shape[:1], jnp.int32))
  if mode.refreshing:

    def refreshed(carry):
      """A refresh step, then the cached steps up to the next refresh: the refresh's K/V are
      the inner loop's constant, never a carry or a branch's operand, so never copied."""
      forward, kv = mode.refresh(canvas, carry[1], start)

      def cached(carry):
        return commit(*carry, mode.step(canvas, carry[1], kv, start, static_start))

      return jax.lax.while_loop(
        lambda c: (c[0] % refresh_every != 0) & unfinished(c), cached, commit(*carry, forward)
      )

    _, x_BL, buffers, _ = jax.lax.while_loop(unfinished, refreshed, carry)
  else:

    def body(carry):
      step, x, buffers, post_B = carry
      return commit(step, x, buffers, post_B, mode.step(canvas, x, state, start, static_start))

    _, x_BL, buffers, _ = jax.lax.while_loop(unfinished, body, carry)
  return x_BL, buffers


def decode_canvas_blocks(
  canvas, x_BL, state, buffers, *, mode, key, records, eos_id, first_index=0
):
  """(blocks decoded, canvas, state, records' buffers) after the canvas's blocks b = 0, 1, ...
  (starting at canvas.block_start(b)) while b < canvas.num_blocks and some row needs block b
  (b < canvas.blocks_needed; with stop_at_eos, until every row's text has ended): each block
  decode_one_block, then the mode's store. The block loop of every decode: decode_blocks runs it
  over a whole completion, the server's program (make_block_fn) over the blocks of one call.
  first_index: the blocks' index in their decode (the step keys' and records' block index).

  One while loop; a mode whose forward's shape depends on the block (static_blocks: truncate,
  prefix) unrolls the blocks instead, each under a cond, its start a Python int (canvas.prefill
  is one for such modes)."""
  blocks = dict(mode=mode, key=key, records=records, eos_id=eos_id)

  def go_on(block_index, x_BL):
    """Whether block block_index is decoded: some row still needs it and has not finished."""
    wanted = block_index < canvas.blocks_needed
    if not canvas.sampling.stop_at_eos:
      return wanted
    return wanted & ~jnp.all(_finished(canvas, x_BL, eos_id))

  def decode_block(block_index, x_BL, state, buffers, static_start):
    start = canvas.block_start(block_index)
    x_BL, buffers = decode_one_block(
      canvas, first_index + block_index, x_BL, state, buffers, start, static_start, **blocks
    )
    state = mode.store(canvas, x_BL, state, start, go_on(block_index + 1, x_BL))
    return x_BL, state, buffers

  ran = jnp.int32(0)
  if mode.static_blocks:  # one unrolled loop iteration per block, its start a Python int.
    for b in range(canvas.num_blocks):
      decoded = go_on(b, x_BL)
      x_BL, state, buffers = jax.lax.cond(
        decoded,
        lambda x, s, r, b=b: decode_block(b, x, s, r, canvas.block_start(b)),
        lambda x, s, r: (x, s, r),
        x_BL,
        state,
        buffers,
      )
      ran = ran + decoded.astype(jnp.int32)
    return ran, x_BL, state, buffers
  return jax.lax.while_loop(
    lambda carry: (carry[0] < canvas.num_blocks) & go_on(carry[0], carry[1]),
    lambda carry: (carry[0] + 1, *decode_block(carry[0], *carry[1:], None)),
    (ran, x_BL, state, buffers),
  )
