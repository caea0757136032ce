"""The diffusion.* and sampler.* keys, checked beside the losses and the sampler that read them
(registered with dlmjax.config's validation registry)."""

from __future__ import annotations

from dlmjax.config import ConfigError, registry
from dlmjax.diffusion import cache_modes, choices, sampler_settings

registry.choices('diffusion.objective', choices.OBJECTIVES)
registry.choices('diffusion.block_parameterization', choices.BLOCK_PARAMETERIZATIONS)
registry.choices('sampler.cache', cache_modes.MODES)
registry.choices('sampler.schedule', choices.SAMPLER_SCHEDULES)


@registry.check
def diffusion_objective(config):
  """Each objective's attention mask and prediction alignment."""
  objective, m = config.diffusion.objective, config.model
  if objective == 'ar' and m.attention_mask != 'causal':
    raise ConfigError('diffusion.objective=ar needs --config.model.attention_mask=causal.')
  if objective == 'ar' and m.shift_logits:
    raise ConfigError(
      'diffusion.objective=ar already predicts the next token; model.shift_logits=True would '
      'shift it twice: set --config.model.shift_logits=false.'
    )
  if objective == 'block' and m.attention_mask != 'block_causal':
    raise ConfigError(
      'diffusion.objective=block trains a block_causal model (it decodes block by block); '
      'set --config.model.attention_mask=block_causal.'
    )
  if objective == 'block' and m.shift_logits:
    raise ConfigError(
      'diffusion.objective=block predicts each token at its own position (BD3LM, SDAR); set '
      '--config.model.shift_logits=false.'
    )
  if not 0.0 <= config.diffusion.varlen_prob <= 1.0:
    raise ConfigError(f'diffusion.varlen_prob={config.diffusion.varlen_prob} must be in [0, 1].')


@registry.check
def sampler_group(config):
  sampler_settings.check_sampler_settings(config.sampler, prefix='sampler.')
  cache, m = config.sampler.cache, config.model
  if cache in ('truncate', 'block') and m.attention_mask == 'bidirectional':
    raise ConfigError(
      f'sampler.cache={cache} is exact only for causal or block_causal models, and '
      'model.attention_mask=bidirectional; use sampler.cache=none, prefix or dual.'
    )
