"""The masked-diffusion sampler: LLaDA's semi-autoregressive remasking loop, jitted and batched.

The completion canvas starts as MASK and is decoded block by block, left to right; each step runs
the model, predicts every masked token of the current block, and commits the most confident ones
(LLaDA generate.py, MegaDLMs DiffLM.generate: reference/dlm_peers.md 1.3, megadlms.md 4.5).
Everything is a lax loop over fixed shapes, so one compilation serves every prompt of a width.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.diffusion import (
  cache_modes,
  decode_records,
  decoding,
  multi_block,
  sampler_settings,
  schedules,
)
from dlmjax.diffusion import canvas as canvas_lib
from dlmjax.model import attention, programs
from dlmjax.parallel import distributed, rules

REMASKING = decoding.ORDERS  # the decoding orders (decoding.confidence)
CACHE_MODES = tuple(cache_modes.MODES)  # the forward each step runs (cache_modes/)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Sampling settings; defaults are LLaDA's demo (one token per step, blocks of 32)."""

  gen_length: int = 128
  steps: int = 128
  block_length: int = 32
  temperature: float = 0.0
  top_p: float = 1.0
  cfg_scale: float = 0.0
  remasking: str = 'low_confidence'  # the decoding order (decoding.ORDERS)
  threshold: float = 0.0  # > 0: also commit every masked token this confident (Fast-dLLM).
  cache: str = 'none'
  cache_refresh: int = 0  # prefix / dual: also refresh every this many steps (0 = block start only)
  stop_at_eos: bool = False  # rows whose text is final stop changing; skip finished work.
  alg_temp: float = 0.0  # > 0: draw the schedule's positions from softmax(conf / alg_temp) (Dream)
  factor: float = 0.0  # > 0: also commit the n most confident with c_n >= 1 - factor/(n+1)
  # > 0: LLaDA2.1's T2T editing: a committed token of the block becomes the model's argmax v where
  # p(v) > edit_threshold (decoding.edit_mask); edit_steps: edit-only steps after the masks run out.
  edit_threshold: float = 0.0
  edit_steps: int = 16
  entropy_threshold: float = 0.0  # > 0: also commit every masked token with entropy <= it
  block_add_threshold: float = 0.0  # > 0: d3LLM's multi-block decoding (multi_block.py)
  schedule: str = 'auto'  # tokens per step: linear (LLaDA) | dream | auto (schedules.py)
  eps: float = 1e-3  # Dream's schedule: times on linspace(1, eps, steps_per_block + 1)
  mask_in_softmax: bool = False  # the orders score a softmax with MASK in it (LLaDA's, Dream's)

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block_length

  @property
  def steps_per_block(self) -> int:
    return self.steps // self.num_blocks

  def validate(self) -> 'SamplingConfig':
    """Raises ConfigError (a ValueError) naming the setting to change; returns self."""
    sampler_settings.check_sampler_settings(self)
    if self.cache not in CACHE_MODES:
      raise ValueError(f'unknown cache {self.cache!r}; known: {CACHE_MODES}.')
    if self.cache_refresh and self.cache not in ('prefix', 'dual'):
      raise ValueError(
        f'cache_refresh={self.cache_refresh} refreshes an approximate cache; it needs '
        f"cache='prefix' or 'dual' (this is {self.cache!r}): set cache_refresh=0."
      )
    return self

  @classmethod
  def from_config(cls, config) -> 'SamplingConfig':
    """The run's sampler group (config.sampler of the whole run config), validated; a bad
    setting raises ConfigError naming its sampler.* key."""
    try:
      return cls.from_values(**config.sampler.to_dict()).validate()
    except ValueError as e:
      raise config_lib.ConfigError(f'config.sampler: {e} (set --config.sampler.KEY)') from e

  @classmethod
  def from_values(cls, **values) -> 'SamplingConfig':
    """Settings from field values, strings (lm-eval model_args, flags) read as the field's type;
    not validated. An unknown name fails naming the fields."""
    defaults = cls()
    fields = {}
    for name, value in values.items():
      if not hasattr(defaults, name) or name in ('num_blocks', 'steps_per_block'):
        raise ValueError(f'{name!r} is not a sampler setting; known: {FIELDS}.')
      default = getattr(defaults, name)
      if isinstance(default, bool) and isinstance(value, str):
        if value.lower() not in ('true', 'false', '1', '0'):
          raise ValueError(f'{name}={value!r} is not a bool; use true or false.')
        value = value.lower() in ('true', '1')
      elif not isinstance(default, bool) and isinstance(default, (int, float)):
        value = type(default)(value)
      fields[name] = value
    return cls(**fields)


FIELDS = tuple(field.name for field in dataclasses.fields(SamplingConfig))
# The command-line flag of each field (generate and evaluate); cfg_scale is --cfg as in
# evaluate's likelihood mode and lm-eval's model_args.
FLAGS = {name: '--' + name.replace('_', '-') for name in FIELDS} | {'cfg_scale': '--cfg'}
_HELP = {
  'temperature': '0 = greedy',
  'cfg_scale': 'CFG scale (0 = off)',
  'remasking': ' | '.join(REMASKING),
  'threshold': 'also commit tokens at least this confident (0 = off)',
  'cache': ' | '.join(CACHE_MODES),
  'cache_refresh': 'prefix / dual: refresh the K/V every this many steps (0 = at block start)',
  'stop_at_eos': 'rows whose text ended (an EOS, nothing masked before it) stop; skip the rest',
  'alg_temp': "Dream's: draw the positions from softmax(confidence / alg_temp) (0 = top-k)",
  'entropy_threshold': "dParallel's rule: also commit tokens of entropy <= this (0 = off)",
  'block_add_threshold': "d3LLM's multi-block decoding: open the next block once the last is "
  'this decoded (0 = off; d3LLM 0.1)',
  'factor': "Fast-dLLM's factor rule: commit the n most confident with (n+1)(1 - c_n) <= f",
  'edit_threshold': "LLaDA2.1's T2T: replace a committed token by an argmax this confident",
  'edit_steps': 'edit-only steps a block may take once its masks are filled (with edit_threshold)',
  'schedule': "tokens per step: linear (LLaDA's), dream (Dream's), auto (the family's)",
  'eps': "Dream's schedule: linspace(1, eps, steps + 1)",
  'mask_in_softmax': 'score the orders with MASK in the softmax, as LLaDA and Dream do',
}


def add_arguments(parser) -> None:
  """The sampler's flags (FLAGS), defaulting to SamplingConfig's (LLaDA's demo)."""
  defaults = SamplingConfig()
  for name in FIELDS:
    default = getattr(defaults, name)
    if isinstance(default, bool):
      parser.add_argument(
        FLAGS[name], dest=f'sampler_{name}', action='store_true', help=_HELP.get(name)
      )
    else:
      parser.add_argument(
        FLAGS[name],
        dest=f'sampler_{name}',
        type=type(default),
        default=default,
        metavar=name.upper(),
        help=_HELP.get(name),
      )


def from_arguments(args) -> SamplingConfig:
  """The validated settings add_arguments' flags parsed into."""
  return SamplingConfig.from_values(
    **{name: getattr(args, f'sampler_{name}') for name in FIELDS}
  ).validate()


num_transfer_tokens = schedules.num_transfer_tokens  # LLaDA's linear schedule


# The per-token pieces live in decoding.py; these names are the sampler's public API.
gumbel_noise, top_p_filter = decoding.gumbel_noise, decoding.top_p_filter
sample_tokens = decoding.sample_tokens


def step_keys(key, block, step):
  """(noise key, remasking key) of one decoding step: a function of (key, block, step) only."""
  return jax.random.split(jax.random.fold_in(jax.random.fold_in(key, block), step))


def pad_prompts(token_lists, pad_id: int, width: int | None = None):
  """Left-pads token lists to one width: (prompt_BP int32, prompt_lengths_B int32), numpy."""
  lengths = np.array([len(t) for t in token_lists], np.int32)
  longest = int(lengths.max()) if len(lengths) else 0
  width = longest if width is None else width
  if width < longest:
    raise ValueError(f'a prompt has {longest} tokens, more than width={width}; raise the width.')
  prompt_BP = np.full((len(token_lists), width), pad_id, np.int32)
  for row, tokens in enumerate(token_lists):
    if len(tokens):
      prompt_BP[row, width - len(tokens) :] = tokens
  return prompt_BP, lengths


def completions(out_BL, prompt_width: int, eos_id: int) -> list[list[int]]:
  """The generated tokens of each row, cut before the first EOS."""
  result = []
  for row in np.asarray(out_BL)[:, prompt_width:]:
    eos = np.flatnonzero(row == eos_id)
    result.append(row[: eos[0] if len(eos) else len(row)].tolist())
  return result


block_grid = canvas_lib.block_grid  # the sampler's public name (benchmarks, tests).


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
  ran, x_BL, _, buffers = decode_canvas_blocks(
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
    tokens, _, steps, *preds = decode_blocks(
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
    _, x_BL, _, _ = decode_canvas_blocks(
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
