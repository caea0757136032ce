"""The sampler's rules, written once: for the run config's sampler.* group (registered by
diffusion/config_checks.py) and for any SamplingConfig (its validate)."""

from __future__ import annotations

import numbers

from dlmjax.config import ConfigError
from dlmjax.diffusion import choices

_DREAM_ORDERS = {'topk_margin': 'margin', 'origin': 'random'}  # Dream's names that differ
# LLaDA2.1's two decoding modes as sampler settings (`--config.sampler.KEY` / generate's flags),
# the values diffusers' LLaDA2 pipeline documents as recommended (docs api/pipelines/llada2,
# v0.38): Quality M2T 0.7 with edits above 0.5, Speed M2T 0.5 without edits, both 16 edit-only
# steps. The LLaDA2.1 report gives no numbers and describes S mode as relying on edits
# (docs/block_diffusion.md, "LLaDA2.1 editing").
LLADA21_MODES = {
  'quality': dict(threshold=0.7, edit_threshold=0.5, edit_steps=16),
  'speed': dict(threshold=0.5, edit_threshold=0.0, edit_steps=16),
}


def check_sampler_settings(settings, prefix: str = '') -> None:
  """The sampler's rules, written once: for the sampler.* group (prefix 'sampler.') and for any
  sampling_config.SamplingConfig (its validate); raises ConfigError naming the setting."""
  p = prefix
  for key in ('gen_length', 'steps', 'block_length'):
    value = getattr(settings, key)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
      raise ConfigError(f'{p}{key}={value!r} must be a positive integer.')
  gen, block, steps = settings.gen_length, settings.block_length, settings.steps
  if gen % block:
    raise ConfigError(
      f'{p}gen_length={gen} is not a multiple of {p}block_length={block}; pick a block_length '
      'that divides it.'
    )
  if steps % (gen // block):
    raise ConfigError(
      f'{p}steps={steps} is not a multiple of the {gen // block} blocks ({p}gen_length / '
      f'{p}block_length); use steps = k * {gen // block}.'
    )
  if settings.temperature < 0:
    raise ConfigError(f'{p}temperature={settings.temperature} must be >= 0 (0 = greedy).')
  if not 0 < settings.top_p <= 1:
    raise ConfigError(f'{p}top_p={settings.top_p} must lie in (0, 1].')
  if settings.cfg_scale < 0:
    raise ConfigError(f'{p}cfg_scale={settings.cfg_scale} must be >= 0 (0 = off).')
  if not 0 <= settings.threshold <= 1:
    raise ConfigError(f'{p}threshold={settings.threshold} must lie in [0, 1] (0 = off).')
  order = settings.remasking
  if order not in choices.REMASKING_ORDERS:
    hint = (
      f" (Dream's {order} is closest to {_DREAM_ORDERS[order]!r})" if order in _DREAM_ORDERS else ''
    )
    raise ConfigError(
      f'{p}remasking={order!r} is not a decoding order{hint}; use one of '
      f'{choices.REMASKING_ORDERS}.'
    )
  if not settings.alg_temp >= 0:
    raise ConfigError(
      f'{p}alg_temp={settings.alg_temp} must be >= 0 (0 = the most confident, > 0 = drawn).'
    )
  if not settings.entropy_threshold >= 0:
    raise ConfigError(
      f'{p}entropy_threshold={settings.entropy_threshold} must be >= 0 (0 = off; dParallel: 0.5).'
    )
  if not settings.factor >= 0:
    raise ConfigError(f'{p}factor={settings.factor} must be >= 0 (0 = off; Fast-dLLM uses 1).')
  if settings.threshold > 0 and settings.factor > 0:
    raise ConfigError(
      f'{p}threshold={settings.threshold} and {p}factor={settings.factor} are two alternative '
      'rules of Fast-dLLM; set one of them to 0.'
    )
  if order == 'entropy' and (settings.threshold > 0 or settings.factor > 0):
    raise ConfigError(
      f'{p}threshold and {p}factor bound a probability, but {p}remasking=entropy scores a '
      'negative entropy; use remasking low_confidence, maskgit_plus or margin with them.'
    )
  edit, edit_steps = getattr(settings, 'edit_threshold', 0.0), getattr(settings, 'edit_steps', 0)
  if not 0 <= edit < 1:
    raise ConfigError(
      f'{p}edit_threshold={edit} must lie in [0, 1) (0 = no editing; LLaDA2.1 Q mode: 0.5).'
    )
  if not isinstance(edit_steps, numbers.Integral) or isinstance(edit_steps, bool) or edit_steps < 0:
    raise ConfigError(f'{p}edit_steps={edit_steps!r} must be an integer >= 0 (LLaDA2.1: 16).')
  if settings.schedule not in choices.SAMPLER_SCHEDULES:
    raise ConfigError(
      f'{p}schedule={settings.schedule!r} is not a schedule; use one of '
      f'{choices.SAMPLER_SCHEDULES}.'
    )
  if not 0 < settings.eps < 1:
    raise ConfigError(f"{p}eps={settings.eps} must lie in (0, 1) (Dream's default 1e-3).")
  _check_multi_block(settings, p)
  refresh, spb = settings.cache_refresh, steps // (gen // block)
  if not isinstance(refresh, numbers.Integral) or refresh < 0 or (refresh and spb % refresh):
    raise ConfigError(
      f'{p}cache_refresh={refresh!r} must be 0 (refresh at block start only) or divide the '
      f'{spb} steps per block ({p}steps / blocks); pick a divisor of {spb}.'
    )


def _check_multi_block(settings, p: str) -> None:
  """d3LLM's multi-block decoding (block_add_threshold > 0): its own loop and commit rule."""
  add = settings.block_add_threshold
  if not 0 <= add <= 1:
    raise ConfigError(f'{p}block_add_threshold={add} must lie in [0, 1] (0 = off; d3LLM: 0.1).')
  if add == 0:
    return
  if settings.cache != 'none':
    raise ConfigError(
      f'{p}block_add_threshold={add} (multi-block decoding) runs the whole canvas each step; '
      f'set {p}cache=none (this is {settings.cache!r}).'
    )
  others = {'threshold': settings.threshold, 'factor': settings.factor}
  others['alg_temp'] = settings.alg_temp
  for key, value in others.items():
    if value > 0:
      raise ConfigError(
        f'{p}{key}={value} has no effect under multi-block decoding ({p}block_add_threshold='
        f'{add}), which commits by entropy ({p}entropy_threshold); set {p}{key}=0.'
      )
  if settings.stop_at_eos:
    raise ConfigError(
      f'{p}stop_at_eos is not built for multi-block decoding ({p}block_add_threshold={add}); '
      f'set {p}stop_at_eos=false.'
    )
