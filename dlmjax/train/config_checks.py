"""The stage, train.*, checkpoint.*, log.*, eval.*, sft.* and preference.* keys, checked beside
the training loop that reads them (registered with dlmjax.config's validation registry); like
every config_checks module it imports no jax, so a config is checked before jax loads."""

from __future__ import annotations

from dlmjax.config import ConfigError, get_key, log_outputs, ramp_steps, registry
from dlmjax.config import stages as config_stages
from dlmjax.observability import choices as log_choices
from dlmjax.rl import budget
from dlmjax.train import choices

config_stages.register(choices.STAGES)
registry.choices('train.schedule', choices.SCHEDULES)
registry.choices('sft.too_long', choices.TOO_LONG)


@registry.check
def training(config):
  t = config.train
  for key in ('steps', 'global_batch_size', 'micro_batch_size'):
    if t[key] <= 0:
      raise ConfigError(f'train.{key}={t[key]} must be positive.')
  if t.global_batch_size % t.micro_batch_size:
    raise ConfigError(
      f'train.global_batch_size={t.global_batch_size} is not a multiple of '
      f'train.micro_batch_size={t.micro_batch_size}; pick a micro-batch that '
      'divides it (gradients accumulate over global/micro steps).'
    )
  if not t.lr > 0 or not t.min_lr >= 0:  # a negative rate ascends the loss without a word
    raise ConfigError(
      f'train.lr={t.lr} must be > 0 and train.min_lr={t.min_lr} >= 0 (the peak and the floor '
      'of the schedule); e.g. --config.train.lr=3e-3.'
    )
  if ramp_steps(t) > t.steps:
    raise ConfigError(
      f'train.warmup_steps + train.wsd_decay_steps = {ramp_steps(t)} exceeds '
      f'train.steps={t.steps}; lower --config.train.warmup_steps and '
      '--config.train.wsd_decay_steps.'
    )
  if t.max_consecutive_skips < 0:
    raise ConfigError(f'train.max_consecutive_skips={t.max_consecutive_skips} must be >= 0.')
  if t.spike_factor < 0 or t.spike_window < 0 or 0 < t.spike_factor <= 1:
    raise ConfigError(
      f'train.spike_factor={t.spike_factor} must be 0 (off) or above 1, and '
      f'train.spike_window={t.spike_window} >= 0.'
    )


@registry.check
def saving_logging_and_evaluation(config):
  if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
    raise ConfigError('checkpoint.every must be >= 0 and checkpoint.keep >= 1.')
  for key in ('checkpoint.every_minutes', 'checkpoint.keep_every', 'train.max_minutes'):
    if get_key(config, key) < 0:
      raise ConfigError(f'{key}={get_key(config, key)} must be >= 0 (0 turns it off).')
  if config.log.every < 1:
    raise ConfigError(f'log.every={config.log.every} must be >= 1.')
  if config.eval.every < 0 or config.eval.batches < 1:
    raise ConfigError(
      f'eval.every={config.eval.every} must be >= 0 and eval.batches={config.eval.batches} >= 1.'
    )
  for name in log_outputs(config):
    if name not in log_choices.OUTPUTS:
      raise ConfigError(
        f'log.outputs={config.log.outputs!r} names {name!r}; use a '
        f"comma-separated subset of {log_choices.OUTPUTS} (or '' for none)."
      )


@registry.check(stage='sft')
def sft_stage(config):
  s = config.sft
  if not config.init_from:
    raise ConfigError(
      'stage sft fine-tunes a trained model: set --config.init_from to a dlmjax '
      'run or step directory or a Hugging Face directory.'
    )
  if not s.train_file and config.data.source != 'builtin':
    raise ConfigError(
      'stage sft reads sft.train_file (jsonl), or the built-in instruction set '
      'when data.source=builtin; set --config.sft.train_file=PATH.'
    )


@registry.check(stage='preference')
def preference_stage(config):
  p = config.preference
  if p.budget < 1:
    raise ConfigError(f'preference.budget={p.budget} must be >= 1 masked forward.')
  budget.allocation(p.budget, p.n_time)  # n_time divides the budget (0: the optimal allocation)
  if p.beta <= 0:
    raise ConfigError(f'preference.beta={p.beta} must be > 0 (DPO divides by it).')
  if config.model.attention_mask != 'bidirectional' or config.diffusion.objective != 'mdm':
    raise ConfigError(
      'stage preference estimates the masked-diffusion ELBO of a bidirectional model; set '
      '--config.model.attention_mask=bidirectional and --config.diffusion.objective=mdm.'
    )
  if config.rl.ref_sync_every:
    raise ConfigError(
      'stage preference keeps its reference frozen (DPO); set --config.rl.ref_sync_every=0.'
    )
