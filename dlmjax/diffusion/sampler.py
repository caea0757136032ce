"""The masked-diffusion sampler: LLaDA's semi-autoregressive remasking loop over a batch.

The completion canvas starts as MASK and is decoded block by block, left to right; each step runs
the model, predicts every masked token of the current block, and commits the most confident ones
(LLaDA generate.py, MegaDLMs DiffLM.generate: reference/dlm_peers.md 1.3, megadlms.md 4.5).
Everything is a lax loop over fixed shapes, so one compilation serves every prompt of a width.
This module checks a decode's settings and lays its canvas out and back; the loop itself is
block_loop.py, its settings sampling_config.py, its jitted programs sampler_programs.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from dlmjax.diffusion import block_loop, cache_modes, decode_records, multi_block
from dlmjax.diffusion import canvas as canvas_lib
from dlmjax.diffusion.sampling_config import SamplingConfig


def generate(module, prompt_BP, prompt_lengths_B, sampling: SamplingConfig, key, **kwargs):
  """Decodes gen_length tokens after each left-padded prompt: int32 [B, P + gen_length]
  (decode_blocks without its count and records)."""
  return decode_blocks(module, prompt_BP, prompt_lengths_B, sampling, key, **kwargs)[0]


def decode_blocks(
  module,
  prompt_BP,
  prompt_lengths_B,
  sampling: SamplingConfig,
  key,
  *,
  mask_id: int,
  eos_id: int,
  pad_id: int,
  vocab_size: int | None = None,
  with_predictions: bool = False,
  records: tuple[str, ...] | None = None,
):
  """(int32 [B, P + gen_length]: each left-padded prompt and its gen_length tokens, the number
  of blocks decoded, then each of `records` (decode_records.RECORDS) in the caller's layout):
  the sampler. records defaults to ('steps',), and with_predictions to ('steps', 'predictions'):
  'steps' is int32 [B, gen_length], the step that committed each generated token (-1 if none
  did), counted over the whole decode (block b's step s is b * steps_per_block + s), the
  trajectory TraceRL scores; 'predictions' int32 [B, steps, gen_length], wd1++'s x_0|l (only for
  cache 'none' on a non-block-causal model with every step committing something).

  Per block of block_length tokens, steps_per_block steps; per step a forward (the cache mode's:
  cache_modes/), CFG (logits = u + (s + 1)(c - u), u from a copy whose prompt is MASK),
  predictions x0 (argmax or Gumbel-max), confidence = softmax(logits)[x0] (low_confidence), U(0,
  1) (random) or Dream's orders, and the schedule's count of the most confident masked tokens of the
  block are committed, with Fast-dLLM's threshold or factor rule on top (decoding.commit_step).
  Differences from LLaDA, all without effect on the result: logits, noise and confidence are
  computed for the current block only (positions after it get -inf confidence there, and before
  it nothing is masked); only the completion is decoded (a MASK id inside a prompt stays). MASK
  is never predicted, nor are padded vocabulary rows (>= vocab_size), and by default MASK is out
  of the scores' softmax too (mask_in_softmax: in it, as LLaDA's; README "Generating text" says
  precisely where this differs from LLaDA). The per-step counts are the schedule's (schedules.py:
  LLaDA's even split, Dream's, or the family's with 'auto'). Pads are
  excluded from attention through segment ids and positions start at 0 at each row's first real
  token. Block-causal models decode on block_grid's canvas: a row's first block may open with the
  end of its prompt, and a last block may run past gen_length (those tokens are dropped).

  The blocks are one while loop: with stop_at_eos it ends once every row's text has ended (an
  EOS with nothing masked before it), so gen_length is a maximum and a batch costs the blocks
  its longest text needs; the count says how many ran. A mode whose forward's shape depends on
  the block (truncate, prefix) unrolls the blocks instead. A shifted model (Dream) runs each
  cached slice from one position earlier, the position that predicts its first token.
  """
  sampling.validate()
  mode = cache_modes.get(sampling.cache)
  if records is None:
    records = ('steps', 'predictions') if with_predictions else ('steps',)
  kept = decode_records.get(records)
  gen = sampling.gen_length
  width = prompt_BP.shape[1]
  if mask_id == pad_id:
    raise ValueError(f'pad_id and mask_id are both {mask_id}; pads would be decoded as masks.')
  if width + gen > module.cfg.seq_len:
    raise ValueError(
      f'prompt width {width} + gen_length {gen} = {width + gen} tokens '
      f'exceed the model context (seq_len {module.cfg.seq_len}); shorten the '
      'prompt or gen_length.'
    )
  mode.check(module.cfg, sampling)
  for record in kept:
    record.check(module.cfg, sampling, mode)
  canvas = canvas_lib.Canvas.build(
    module,
    prompt_BP,
    prompt_lengths_B,
    sampling,
    mask_id=mask_id,
    pad_id=pad_id,
    vocab_size=vocab_size or module.cfg.vocab_size,
  )
  if sampling.block_add_threshold > 0:  # d3LLM's multi-block decoding: its own loop
    for record in kept:
      if record.name != 'steps':
        raise ValueError(f'the {record.name!r} record is not kept by multi-block decoding.')
    x_BL, steps_BL, _ = multi_block.decode(canvas, sampling, key, mask_id=mask_id)
    return _outputs(canvas, prompt_BP, x_BL, jnp.int32(canvas.num_blocks), kept, [steps_BL])
  x_BL = canvas.x_BL
  state = mode.init(canvas, x_BL)
  buffers = tuple(r.init(canvas) for r in kept)
  ran, x_BL, _, buffers = block_loop.decode_canvas_blocks(
    canvas, x_BL, state, buffers, mode=mode, key=key, records=kept, eos_id=eos_id
  )
  if sampling.stop_at_eos:  # skipped positions read as EOS, after the end of the text anyway.
    x_BL = jnp.where(canvas.decodable_BL & (x_BL == mask_id), eos_id, x_BL)
  return _outputs(canvas, prompt_BP, x_BL, ran, kept, buffers)


def _outputs(canvas, prompt_BP, x_BL, ran, kept, buffers):
  """Back to the caller's layout: the left-padded prompt, then each row's gen_length tokens;
  the count, then each record's output."""
  gather_BG = canvas.start_B1 + jnp.arange(canvas.sampling.gen_length)[None]
  completion_BG = jnp.take_along_axis(x_BL, gather_BG, axis=1)
  tokens_BW = jnp.concatenate([jnp.asarray(prompt_BP, jnp.int32), completion_BG], axis=1)
  outputs = tuple(r.output(b, canvas, gather_BG) for r, b in zip(kept, buffers))
  return (tokens_BW, ran, *outputs)
