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
from dlmjax.diffusion import decoding, sampler_settings
from dlmjax.model import attention, programs
from dlmjax.parallel import distributed, rules

REMASKING = decoding.ORDERS  # the decoding orders (decoding.confidence)
# 'none': the whole canvas every step. 'truncate': the canvas after the current block is never
# computed, exact only where it cannot be seen (causal and block-causal attention; see generate).
# 'prefix' and 'dual': Fast-dLLM's approximate K/V caches for any attention, refreshed by a whole-
# canvas forward at each block's first step (and every cache_refresh steps); later steps run the
# block and the suffix against the prefix's kept K/V ('prefix'), or the block alone against the
# whole canvas's ('dual'). 'block': an exact cache of the prompt and committed blocks for causal
# and block-causal models; each step runs the current block only. See generate.
CACHE_MODES = ('none', 'truncate', 'prefix', 'dual', 'block')


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
  'factor': "Fast-dLLM's factor rule: commit the n most confident with (n+1)(1 - c_n) <= f",
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


def num_transfer_tokens(num_masked_B, steps: int):
  """[B, steps] tokens to commit per step: n // steps each, the remainder to the first steps.

  LLaDA's get_num_transfer_tokens (the linear schedule of the masked-diffusion reverse process).
  """
  base_B1 = num_masked_B[:, None] // steps
  remainder_B1 = num_masked_B[:, None] % steps
  return base_B1 + (jnp.arange(steps)[None] < remainder_B1).astype(base_B1.dtype)


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


def block_grid(model_cfg) -> int:
  """The unit a canvas is aligned to: model.block_size for block-causal models, else 1.

  A block-causal model's blocks count from each row's first real token (SDAR trains them so,
  from the start of every packed sample), but its mask counts them from canvas position 0. So
  each row is left-padded by whole blocks: its whole prompt blocks end at one canvas position,
  the prefill, and the rest of its prompt (fewer than block_size tokens) opens the first decoded
  block, fixed there, as in SDAR's generate.py (reference/families_and_decoding.md 3.3). Every row
  then sees the block grid it was trained on, whatever its batch-mates' lengths.
  """
  return model_cfg.block_size if model_cfg.attention_mask == 'block_causal' else 1


def _check_exact_cache(module, sampling: SamplingConfig) -> None:
  """'truncate' and 'block' are exact iff no position up to the block end sees past it, and
  ('block') no committed position's K/V depends on a later block."""
  kind, size, mode = module.cfg.attention_mask, module.cfg.block_size, sampling.cache
  if kind == 'causal':
    return
  if kind == 'block_causal':
    if sampling.block_length % size == 0:
      return  # every decoded block starts on the model's grid (block_grid's canvas).
    raise ValueError(
      f'cache={mode!r} needs block_length ({sampling.block_length}) to be a multiple of '
      f'model.block_size ({size}); set block_length to k * {size}.'
    )
  raise ValueError(
    f'cache={mode!r} is exact only for causal or block_causal models; this one is '
    f"{kind} (every token sees the whole canvas): use cache='none', 'prefix' or 'dual'."
  )


def _check_predictions(module, sampling: SamplingConfig) -> None:
  """The per-step predictions (with_predictions) need every row to run every step."""
  if sampling.cache != 'none' or block_grid(module.cfg) > 1:
    raise ValueError(
      f"per-step predictions (wd1++) need cache='none' and a non-block-causal model (this is "
      f'cache={sampling.cache!r}, {module.cfg.attention_mask}): set sampler.cache=none.'
    )
  if (
    sampling.threshold > 0
    or sampling.factor > 0
    or sampling.stop_at_eos
    or sampling.steps_per_block > sampling.block_length
  ):
    raise ValueError(
      'per-step predictions (wd1++) need every step to commit a token: set threshold=0, '
      f'factor=0, stop_at_eos=False and steps_per_block ({sampling.steps_per_block}) <= '
      f'block_length ({sampling.block_length}).'
    )


def generate(module, prompt_BP, prompt_lengths_B, sampling: SamplingConfig, key, **kwargs):
  """Decodes gen_length tokens after each left-padded prompt: int32 [B, P + gen_length]
  (decode_blocks without its count and commit steps)."""
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
):
  """(int32 [B, P + gen_length]: each left-padded prompt and its gen_length tokens, the number
  of blocks decoded, int32 [B, gen_length]: the step that committed each generated token, -1 if
  none did): the sampler. Steps count over the whole decode (block b's step s is b *
  steps_per_block + s), the trajectory TraceRL scores (rl/estimators.py trace_token_logprobs).

  Per block of block_length tokens, steps_per_block steps; per step a forward over the canvas,
  CFG (logits = u + (s + 1)(c - u), u from a copy whose prompt is MASK), predictions x0 (argmax or
  Gumbel-max), confidence = softmax(logits)[x0] (low_confidence), U(0, 1) (random) or Dream's
  orders, and the num_transfer_tokens most confident masked tokens of the block are committed, with
  Fast-dLLM's threshold or factor rule on top (the commit rule: decoding.commit_step).
  Differences from LLaDA, all without effect on the result: logits, noise and confidence are
  computed for the current block only (positions after it get -inf confidence there, and before
  it nothing is masked); only the completion is decoded (a MASK id inside a prompt stays). Two
  differences that matter only for untrained models: MASK is never predicted (LLaDA would commit
  it and leave the position masked), nor are padded vocabulary rows (>= vocab_size). Pads are
  excluded from attention through segment ids and positions start at 0 at each row's first real
  token. Block-causal models decode on block_grid's canvas: a row's first block may open with the
  end of its prompt, and a last block may run past gen_length (those tokens are dropped).

  The blocks are one while loop: with stop_at_eos it ends once every row's text has ended (an
  EOS with nothing masked before it), so gen_length is a maximum and a batch costs the blocks
  its longest text needs; the count says how many ran.

  with_predictions (wd1++'s stepwise targets, rl/rollout.py): a fourth output, int32 [B, steps,
  gen_length]: x_0|l, the clean completion predicted at each step l from the state before it,
  committed tokens kept, every still-masked token filled with the prediction: in the current
  block the x0 the step commits from, after it the argmax of the same forward's logits (CFG and
  the forbidden tokens as in the block). Only for cache 'none' on a non-block-causal model, with
  every step committing something (no threshold, factor or stop_at_eos, steps_per_block <=
  block_length), so that every row runs every step; the extra whole-canvas logits are computed
  block by block only in this mode.

  The cache modes change only the forward. 'prefix' / 'dual' (Fast-dLLM v1, generate_with_prefix_
  cache / generate_with_dual_cache): a refresh step is the whole-canvas forward, keeping every
  layer's K/V; the other steps run [block start, canvas end) ('prefix', one static shape per
  block) or the block alone ('dual') with their fresh K/V in place of the kept ones. 'block'
  (SDAR's and BD3LM's block K/V cache): one forward of the prompt's whole blocks fills the cache,
  each step runs the current block against it, and once a block is committed one more forward
  of it appends its K/V, never recomputed. A shifted model (Dream) runs each cached slice from
  one position earlier, the position that predicts its first token.
  """
  sampling.validate()
  batch, width = prompt_BP.shape
  block, spb, mode = sampling.block_length, sampling.steps_per_block, sampling.cache
  gen = sampling.gen_length
  if mask_id == pad_id:
    raise ValueError(f'pad_id and mask_id are both {mask_id}; pads would be decoded as masks.')
  if width + gen > module.cfg.seq_len:
    raise ValueError(
      f'prompt width {width} + gen_length {gen} = {width + gen} tokens '
      f'exceed the model context (seq_len {module.cfg.seq_len}); shorten the '
      'prompt or gen_length.'
    )
  if mode in ('truncate', 'block'):
    _check_exact_cache(module, sampling)
  if with_predictions:
    _check_predictions(module, sampling)
  # Shifted models (model.shift_logits, Dream) read token i's prediction at position i-1: a cached
  # slice starts one position early, so its first token's predictor runs with it, against the
  # same K/V as the rest of the slice (exact wherever the cache is; one extra query row).
  lead = int(getattr(module.cfg, 'shift_logits', False))
  refresh_every = sampling.cache_refresh or spb
  vocab_size = vocab_size or module.cfg.vocab_size

  # The canvas (block_grid): [pads | whole prompt blocks | prompt rest, completion | ...].
  grid = block_grid(module.cfg)
  prefill = width // grid * grid  # the prompt's whole blocks end here in every row.
  num_blocks = -(-(grid - 1 + gen) // block) if grid > 1 else sampling.num_blocks
  length = prefill + num_blocks * block
  lengths_B1 = jnp.asarray(prompt_lengths_B, jnp.int32)[:, None]
  start_B1 = prefill + lengths_B1 % grid  # each row's completion starts here.
  offset_B1 = start_B1 - lengths_B1  # and its first real token here.
  blocks_needed = (jnp.max(start_B1) - prefill + gen + block - 1) // block
  index_1L = jnp.arange(length)[None]
  real_BL = index_1L >= offset_B1
  prompt_real_BL = real_BL & (index_1L < start_B1)
  decodable_BL = index_1L >= start_B1
  segment_ids_BL = jnp.broadcast_to(real_BL.astype(jnp.int32), (batch, length))
  positions_BL = jnp.maximum(index_1L - offset_B1, 0)
  prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
  if width:
    source_BL = jnp.clip(index_1L - offset_B1 + (width - lengths_B1), 0, width - 1)
    prompt_tokens_BL = jnp.take_along_axis(prompt_BP, jnp.broadcast_to(source_BL, real_BL.shape), 1)
  else:
    prompt_tokens_BL = jnp.full((batch, length), pad_id, jnp.int32)
  x_BL = jnp.where(prompt_real_BL, prompt_tokens_BL, jnp.where(real_BL, mask_id, pad_id))
  cfg_on = sampling.cfg_scale > 0
  if cfg_on:  # the conditional rows, then the unconditional ones (prompt masked).
    segments_all, positions_all = (jnp.concatenate([a, a]) for a in (segment_ids_BL, positions_BL))
  else:
    segments_all, positions_all = segment_ids_BL, positions_BL

  def model_tokens(x_BL):
    if not cfg_on:
      return x_BL
    return jnp.concatenate([x_BL, jnp.where(prompt_real_BL, mask_id, x_BL)])

  def guided(hidden_BQD, start):
    """float32 logits [B, block, V] of the block at hidden's row `start`, CFG applied."""
    logits = module.logits(jax.lax.dynamic_slice_in_dim(hidden_BQD, start, block, axis=1))
    if cfg_on:
      cond, uncond = logits[:batch], logits[batch:]
      logits = uncond + (sampling.cfg_scale + 1) * (cond - uncond)
    vocab_V = jnp.arange(logits.shape[-1])
    return jnp.where((vocab_V < vocab_size) & (vocab_V != mask_id), logits, -jnp.inf)

  def finished(x_BL):
    """Rows frozen by stop_at_eos (decoding.finished_rows), or None."""
    if not sampling.stop_at_eos:
      return None
    return decoding.finished_rows(x_BL, start_B1[:, 0], mask_id=mask_id, eos_id=eos_id)

  def block_logits(x_BL, start, view):
    """The current block's logits from a forward over x[:view] (no cache)."""
    tokens = model_tokens(x_BL)[:, :view]
    hidden = module.hidden(
      tokens, segment_ids_BL=segments_all[:, :view], positions_BL=positions_all[:, :view]
    )
    return guided(hidden, start)

  def canvas_kv(x_BL, start, view=length):
    """(block logits, every layer's K/V) of a forward over x[:view]: a cache refresh (the whole
    canvas) or the block cache's prefill (the prompt's whole blocks)."""
    hidden, kv = module.hidden_kv(
      model_tokens(x_BL)[:, :view],
      positions_BL=positions_all[:, :view],
      segment_ids_BL=segments_all[:, :view],
    )
    return guided(hidden, start), kv

  def slice_kv(x_BL, kv, start, size):
    """(block logits, the slice's fresh K/V, where they start) of the canvas slice [start, start
    + size) against kv, from `lead` positions earlier (a shifted model's predictor of the slice's
    first token; none before position 0); the fresh K/V take kv's place inside the forward, kv
    itself is left as it is."""
    total = min(size + lead, length)
    first = jnp.maximum(start - lead, 0)
    window = lambda a: jax.lax.dynamic_slice_in_dim(a, first, total, axis=1)  # noqa: E731
    hidden, kv = module.hidden_kv(
      window(model_tokens(x_BL)),
      positions_BL=window(positions_all),
      segment_ids_BL=segments_all,
      kv_cache=kv,
      cache_start=first,
    )
    return guided(hidden, start - first), kv, first

  def window(a_BL, start):
    return jax.lax.dynamic_slice_in_dim(a_BL, start, block, axis=1)

  def decode_step(x_BL, logits, block_index, step, start, transfer_B, with_x0=False):
    """Commits tokens of the block [start, start + block) from its logits (with_x0: and the
    block's predictions it commits from)."""
    out = decoding.commit_step(
      logits,
      window(x_BL, start),
      transfer_B,
      step_keys(key, block_index, step),
      sampling,
      mask_id=mask_id,
      frozen_B=finished(x_BL),
      decodable_BK=window(decodable_BL, start),
      with_x0=with_x0,
    )
    x_blk, x0_blk = out if with_x0 else (out, None)
    x_BL = jax.lax.dynamic_update_slice_in_dim(x_BL, x_blk, start, axis=1)
    return (x_BL, x0_blk) if with_x0 else x_BL

  def step_logits(x_BL, kv, start, static_start):
    """The step's block logits for none, truncate and block; truncate knows the block start
    statically (static_start): its forward's shape needs it."""
    if mode == 'none':
      return block_logits(x_BL, start, length)
    if mode == 'truncate':
      return block_logits(x_BL, start, static_start + block)
    return slice_kv(x_BL, kv, start, block)[0]

  def predicting_logits(x_BL, start):
    """(the block's logits, int32 [B, length]: every decoded block's argmax) of one whole-canvas
    forward (cache 'none'); the canvas's logits are made one block at a time."""
    tokens = model_tokens(x_BL)
    hidden = module.hidden(tokens, segment_ids_BL=segments_all, positions_BL=positions_all)
    starts = prefill + block * jnp.arange(num_blocks)
    argmax_NBK = jax.lax.map(lambda s: jnp.argmax(guided(hidden, s), -1).astype(jnp.int32), starts)
    decoded_BL = jnp.moveaxis(argmax_NBK, 0, 1).reshape(batch, num_blocks * block)
    return guided(hidden, start), jnp.concatenate([x_BL[:, :prefill], decoded_BL], axis=1)

  def go_on(block_index, x_BL):
    """Whether block block_index is decoded: some row still needs it and has not finished."""
    wanted = block_index < blocks_needed
    return wanted if not sampling.stop_at_eos else wanted & ~jnp.all(finished(x_BL))

  def decode_block(block_index, x_BL, kv, record, static_start):
    start = prefill + block_index * block
    left_BK = (window(x_BL, start) == mask_id) & window(decodable_BL, start)
    transfer_BS = num_transfer_tokens(jnp.sum(left_BK, -1), spb)

    def unfinished(carry):
      step, x = carry[:2]
      left_BK = (window(x, start) == mask_id) & window(decodable_BL, start)
      done_B = finished(x)
      if done_B is not None:
        left_BK = left_BK & ~done_B[:, None]
      return (step < spb) & jnp.any(left_BK)  # with a threshold or factor, a block can end early.

    def commit(step, x, record, logits, later_x0=None):
      """One step's commits, each token's step recorded (TraceRL's trajectory); with
      predictions (later_x0: the canvas's argmax) also the step's x_0|l."""
      transfer_B = jax.lax.dynamic_index_in_dim(transfer_BS, step, axis=1, keepdims=False)
      predicting = later_x0 is not None
      new_x = decode_step(x, logits, block_index, step, start, transfer_B, with_x0=predicting)
      if predicting:
        new_x, x0_blk = new_x
      committed = (x == mask_id) & (new_x != mask_id)
      steps = jnp.where(committed, block_index * spb + step, record[0])
      if not predicting:
        return step + 1, new_x, (steps, *record[1:])
      x0_BL = jax.lax.dynamic_update_slice_in_dim(later_x0, x0_blk, start, axis=1)
      predicted_BL = jnp.where((x == mask_id) & decodable_BL, x0_BL, x)
      preds = jax.lax.dynamic_update_index_in_dim(
        record[1], predicted_BL, block_index * spb + step, axis=0
      )
      return step + 1, new_x, (steps, preds)

    if mode in ('prefix', 'dual'):
      size = block if mode == 'dual' else length - static_start

      def refreshed(carry):
        """A refresh step, then the cached steps up to the next refresh: the refresh's K/V are
        the inner loop's constant, never a carry or a branch's operand, so never copied."""
        logits, kv = canvas_kv(carry[1], start)

        def cached(carry):
          return commit(*carry, slice_kv(carry[1], kv, start, size)[0])

        return jax.lax.while_loop(
          lambda c: (c[0] % refresh_every != 0) & unfinished(c), cached, commit(*carry, logits)
        )

      _, x_BL, record = jax.lax.while_loop(unfinished, refreshed, (jnp.int32(0), x_BL, record))
      return x_BL, kv, record

    def body(carry):
      step, x, kv, steps = carry
      if with_predictions:
        logits, later_x0 = predicting_logits(x, start)
        step, x, steps = commit(step, x, steps, logits, later_x0)
      else:
        step, x, steps = commit(step, x, steps, step_logits(x, kv, start, static_start))
      return step, x, kv, steps

    _, x_BL, kv, record = jax.lax.while_loop(unfinished, body, (jnp.int32(0), x_BL, kv, record))
    if mode == 'block':  # the committed block's own K/V, what every later block attends to.

      def store(x, c):
        _, fresh, first = slice_kv(x, c, start, block)
        return tuple(
          jax.lax.dynamic_update_slice_in_dim(a, f, first, axis=2) for a, f in zip(c, fresh)
        )

      kv = jax.lax.cond(go_on(block_index + 1, x_BL), store, lambda x, c: c, x_BL, kv)
    return x_BL, kv, record

  kv = None  # the block cache's K/V buffers, which the loop carries (prefix / dual: per block).
  if mode == 'block':
    shapes = jax.eval_shape(lambda x: canvas_kv(x, 0)[1], x_BL)
    kv = tuple(
      rules.constrain(
        jnp.zeros(a.shape, a.dtype), (None, rules.BATCH, None, rules.ATTN_HEADS, None)
      )
      for a in shapes
    )
  if mode == 'block' and prefill:  # SDAR's prefill: the prompt's whole blocks, once.
    kv = tuple(
      jax.lax.dynamic_update_slice_in_dim(a, new.astype(a.dtype), 0, axis=2)
      for a, new in zip(kv, canvas_kv(x_BL, 0, prefill)[1])
    )
  ran = jnp.int32(0)
  # The step that committed each token (and, with predictions, each step's x_0|l).
  record = (jnp.full((batch, length), -1, jnp.int32),)
  if with_predictions:
    record += (jnp.full((num_blocks * spb, batch, length), mask_id, jnp.int32),)
  if mode in ('truncate', 'prefix'):  # static shapes: one unrolled loop iteration per block.
    for b in range(num_blocks):
      decoded = go_on(b, x_BL)
      x_BL, kv, record = jax.lax.cond(
        decoded,
        lambda x, c, t, b=b: decode_block(b, x, c, t, prefill + b * block),
        lambda x, c, t: (x, c, t),
        x_BL,
        kv,
        record,
      )
      ran = ran + decoded.astype(jnp.int32)
  else:
    ran, x_BL, kv, record = jax.lax.while_loop(
      lambda carry: (carry[0] < num_blocks) & go_on(carry[0], carry[1]),
      lambda carry: (carry[0] + 1, *decode_block(carry[0], *carry[1:], None)),
      (ran, x_BL, kv, record),
    )
  # Back to the caller's layout: the left-padded prompt, then each row's gen_length tokens.
  gather_BG = start_B1 + jnp.arange(gen)[None]
  completion_BG = jnp.take_along_axis(x_BL, gather_BG, axis=1)
  if sampling.stop_at_eos:  # skipped positions read as EOS, after the end of the text anyway.
    completion_BG = jnp.where(completion_BG == mask_id, eos_id, completion_BG)
  steps_BG = jnp.take_along_axis(record[0], gather_BG, axis=1)
  tokens_BW = jnp.concatenate([prompt_BP, completion_BG], axis=1)
  if not with_predictions:
    return tokens_BW, ran, steps_BG
  preds_BSL = jnp.moveaxis(record[1], 0, 1)
  preds_BSG = jnp.take_along_axis(preds_BSL, gather_BG[:, None], axis=2)
  return tokens_BW, ran, steps_BG, preds_BSG


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
):
  """jit(fn(params, prompt_BP, prompt_lengths_B, key) -> int32 [B, P + gen_length]; with_steps,
  also each generated token's commit step [B, gen_length]; with_predictions, the commit steps
  and each step's predicted completion [B, steps, gen_length] (decode_blocks)).

  With a mesh, params take their training shardings and the batch splits over the batch axes;
  with several processes each passes the whole (identical) batch and gets a global array back.
  cuDNN attention cannot exclude left padding by segment ids: a cudnn model samples with 'auto'
  attention (the Pallas kernel on GPU, XLA elsewhere).
  """
  sampling.validate()
  if model_config.attention_backend == 'cudnn':
    model_config = dataclasses.replace(
      model_config, attention_backend='auto' if 'auto' in attention.BACKENDS else 'xla'
    )

  def fn(params, prompt_BP, prompt_lengths_B, key):
    # cast once, not once a step (model.transformer.computed_params)
    module = model_lib.merge(model_config, model_lib.computed_params(model_config, params))
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
