"""The sampler's settings (SamplingConfig) and their command-line flags: one dataclass that
generate, evaluate, serving, RL and the lm-eval adapter all read, so a setting means the same
everywhere (reference/dlm_peers.md 1.3: LLaDA's generate.py arguments)."""

from __future__ import annotations

import dataclasses

from dlmjax import config as config_lib
from dlmjax.diffusion import cache_modes, decoding, sampler_settings

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
