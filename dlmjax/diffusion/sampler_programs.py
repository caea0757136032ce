"""The sampler's compiled programs: make_generate_fn (a whole decode, sampler.decode_blocks),
make_block_fn (the server's next blocks of rows at their own blocks, block_loop) and
make_prefix_fn (a shared prefix's K/V), each jitted once per setting and lru-cached, so every
caller of a setting shares one compilation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax.diffusion import block_loop, cache_modes, sampler
from dlmjax.diffusion import canvas as canvas_lib
from dlmjax.diffusion.sampling_config import SamplingConfig
from dlmjax.model import attention, programs
from dlmjax.parallel import distributed, rules


def _decoding_config(model_config):
  """cuDNN attention cannot exclude pads by segment ids: a cudnn model decodes with 'auto'."""
  if model_config.attention_backend != 'cudnn':
    return model_config
  return dataclasses.replace(
    model_config, attention_backend='auto' if 'auto' in attention.BACKENDS else 'xla'
  )


@functools.lru_cache(maxsize=32)  # one compilation per setting, shared by every caller.
def make_generate_fn(
  model_config,
  sampling: SamplingConfig,
  *,
  mask_id: int,
  eos_id: int,
  pad_id: int,
  mesh=None,
  vocab_size: int | None = None,
  with_steps: bool = False,
  with_predictions: bool = False,
  fuse_projections: bool = True,
  experts_in_place: bool = True,
):
  """jit(fn(params, prompt_BP, prompt_lengths_B, key) -> int32 [B, P + gen_length]; with_steps,
  also each generated token's commit step [B, gen_length]; with_predictions, the commit steps
  and each step's predicted completion [B, steps, gen_length] (decode_blocks)).

  fuse_projections: decode with q / k / v and gate / up as one matmul each over weights
  concatenated once per generate (model.inference_module; docs/benchmarks.md, Fused
  projections); off (a benchmark's baseline), or on a mesh that splits the heads
  (model.splits_projections), three matmuls and two. experts_in_place: an MoE's routed experts
  read from their stacks in place by every layer (model.transformer._run_layers); off (a
  benchmark's baseline), each layer's experts cut from the stacks, which the Pallas grouped
  matmul then copies each step.

  With a mesh, params take their training shardings and the batch splits over the batch axes;
  with several processes each passes the whole (identical) batch and gets a global array back.
  cuDNN attention cannot exclude left padding by segment ids: a cudnn model samples with 'auto'
  attention (the Pallas kernel on GPU, XLA elsewhere).
  """
  sampling.validate()
  model_config = _decoding_config(model_config)

  def fn(params, prompt_BP, prompt_lengths_B, key):
    # cast (and fuse) once, not once a step (model.transformer.computed_params)
    module = model_lib.inference_module(
      model_config, params, fuse=fuse_projections, mesh=mesh, experts_in_place=experts_in_place
    )
    tokens, _, steps, *preds = sampler.decode_blocks(
      module,
      prompt_BP,
      prompt_lengths_B,
      sampling,
      key,
      mask_id=mask_id,
      eos_id=eos_id,
      pad_id=pad_id,
      vocab_size=vocab_size,
      with_predictions=with_predictions,
    )
    if with_predictions:
      return tokens, steps, preds[0]
    return (tokens, steps) if with_steps else tokens

  if mesh is None:
    return programs.jit_program(fn, model_config.matmul_dtype, decode=True)
  _, _, axes = model_lib.abstract(model_config)
  rows = rules.named_sharding(mesh, (rules.BATCH, None))
  jitted = programs.jit_program(
    fn,
    model_config.matmul_dtype,
    decode=True,
    in_shardings=(
      rules.tree_shardings(mesh, axes),
      rows,
      rules.named_sharding(mesh, (rules.BATCH,)),
      rules.named_sharding(mesh, ()),
    ),
    out_shardings=(
      (rows, rows, rules.named_sharding(mesh, (rules.BATCH, None, None)))
      if with_predictions
      else (rows, rows)
      if with_steps
      else rows
    ),
  )
  shards = int(np.prod([mesh.shape[a] for a in rules.RULES[rules.BATCH]]))

  def sharded(params, prompt_BP, prompt_lengths_B, key):
    if prompt_BP.shape[0] % shards:
      raise ValueError(
        f'batch {prompt_BP.shape[0]} does not split over the {shards} batch '
        f'shards of the mesh; pad the batch to a multiple of {shards}.'
      )
    if jax.process_count() > 1:  # every process passes the whole batch; each places its rows
      prompt_BP = distributed.from_full_host(prompt_BP, rows)
      prompt_lengths_B = distributed.from_full_host(
        prompt_lengths_B, rules.named_sharding(mesh, (rules.BATCH,))
      )
    with rules.activation_mesh(mesh):
      return jitted(params, prompt_BP, prompt_lengths_B, key)

  return sharded


@functools.lru_cache(maxsize=64)  # one compilation per (setting, start), shared by every caller.
def make_block_fn(
  model_config,
  sampling: SamplingConfig,
  *,
  mask_id: int,
  eos_id: int,
  static_start: int | None = None,
  vocab_size: int | None = None,
  reuse_window: int | None = None,
  max_blocks: int = 1,
  out_rows: int = 0,
):
  """jit(fn(params, x_BL, offset_B, start_B, end_B, block_start, key, block_index, blocks) ->
  int32 [max(B, out_rows), max_blocks * block_length]): the next `blocks` (1 to max_blocks,
  traced) blocks of rows that each sit at their own block, the server's call (serve/layout.py).
  Row b's tokens are x[b, offset_b:end_b] (its prompt, its committed blocks, then MASK), its
  completion starts at start_b, and every row's current block is [block_start, block_start +
  block_length), the next ones follow it; the result is the canvas from block_start after
  decode_canvas_blocks, the loop decode_blocks runs (sampling: one block's settings, gen_length
  = block_length; block_index: the first block's index in the decode). A row ending before a
  block has nothing to decode there; what the output holds past the canvas end is meaningless.

  static_start: block_start as a Python int, needed by modes whose forward's shape depends on it
  (static_blocks: these unroll as many of max_blocks as fit in the canvas); the argument is then
  ignored. The block cache takes either: without it, its prefill runs to the canvas's last
  block (cache_modes/block.py), so one program serves every block start of a canvas length. The
  caller lays rows out so that what a row's block attends to is what it attends to in
  generate's canvas: the same tokens at the same positions, pads excluded.

  reuse_window (a mode that reuses_prefix, without CFG): fn takes one more argument, the K/V of
  a prefix every row starts with (make_prefix_fn's), and prefills only the last reuse_window
  positions of the prefill (before static_start, else before the canvas's last block); every
  row's tokens after its stored prefix must lie there.

  out_rows: the output padded to that many rows (the server's next call takes its carried rows
  from it, so one carry program serves every pair of batch sizes).
  """
  sampling.validate()
  model_config = _decoding_config(model_config)
  mode = cache_modes.get(sampling.cache)
  mode.check(model_config, sampling)
  if sampling.num_blocks != 1:
    raise ValueError("a block program runs one block's settings: set gen_length = block_length.")
  if max_blocks < 1:
    raise ValueError(f'max_blocks={max_blocks}: a call decodes at least one block.')
  if static_start is None and mode.static_blocks:
    raise ValueError(f'cache {mode.name!r} needs the block start as a Python int: static_start.')
  if reuse_window is not None and not (
    mode.reuses_prefix
    and 0 < reuse_window
    and (static_start is None or reuse_window <= static_start)
  ):
    raise ValueError(
      f'reuse_window={reuse_window} needs a cache that reuses a stored prefix (this is '
      f'{mode.name!r}) and 0 < reuse_window <= the block start ({static_start}).'
    )
  block = sampling.block_length

  def fn(params, x_BL, offset_B, start_B, end_B, block_start, key, block_index, blocks, *stored):
    module = model_lib.inference_module(model_config, params)
    start = block_start if static_start is None else static_start
    unrolled = max_blocks
    if mode.static_blocks:  # each block's forward must lie inside the canvas
      unrolled = max(1, min(max_blocks, (x_BL.shape[1] - static_start) // block))
    canvas = canvas_lib.Canvas.of_rows(
      module,
      x_BL,
      offset_B,
      start_B,
      end_B,
      sampling,
      prefill=start,  # where every row's prefix ends: a Python int wherever the mode needs one
      num_blocks=unrolled,
      blocks_needed=blocks,
      mask_id=mask_id,
      vocab_size=vocab_size or module.cfg.vocab_size,
    )
    if reuse_window is None:
      state = mode.init(canvas, canvas.x_BL)
    else:
      state = mode.init(canvas, canvas.x_BL, reused=(stored[0], reuse_window))
    _, x_BL, _, _ = block_loop.decode_canvas_blocks(
      canvas, canvas.x_BL, state, (), mode=mode, key=key, records=(), eos_id=eos_id,
      first_index=block_index,
    )  # fmt: skip
    # Padded, so the window never clamps back into the canvas when fewer blocks fit in it.
    x_BW = jnp.pad(x_BL, ((0, max(out_rows - x_BL.shape[0], 0)), (0, max_blocks * block)))
    return jax.lax.dynamic_slice_in_dim(x_BW, start, max_blocks * block, axis=1)

  return programs.jit_program(fn, model_config.matmul_dtype, decode=True)


@functools.lru_cache(maxsize=8)
def make_prefix_fn(model_config):
  """jit(fn(params, tokens_1S) -> every layer's K/V (k, v) [layers, 1, S, K, H] of S tokens at
  positions 0..S-1): a prefix that make_block_fn's reuse_window reads in every row starting with
  it. Exact on a causal model, and on a block-causal one for S on its block grid."""
  model_config = _decoding_config(model_config)

  def fn(params, tokens_1S):
    module = model_lib.inference_module(model_config, params)
    positions = jnp.broadcast_to(jnp.arange(tokens_1S.shape[1]), tokens_1S.shape)
    return module.hidden_kv(
      tokens_1S, positions_BL=positions, segment_ids_BL=jnp.ones_like(positions)
    )[1]

  return programs.jit_program(fn, model_config.matmul_dtype, decode=True)
