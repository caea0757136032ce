"""The rl.* keys, checked beside the RL code that reads them (registered with dlmjax.config's
validation registry); they apply to stage rl only."""

from __future__ import annotations

from dlmjax.config import ConfigError, registry
from dlmjax.rl import choices, objectives


def objective_names() -> tuple[str, ...]:
  """rl.objective's choices: the objectives' registry (rl/objectives/)."""
  return objectives.names()


registry.choices('rl.objective', objective_names())
registry.choices('rl.eval_split', choices.HELD_OUT_SPLITS)
registry.choices('rl.reference_dtype', choices.REFERENCE_DTYPES)


@registry.check(stage='rl')
def rl_run(config):
  """Stage rl: the group, batch, sampler and prompt sizes must fit together."""
  r = config.rl
  if not config.init_from:
    raise ConfigError(
      'stage rl improves a trained (ideally fine-tuned) model: set '
      '--config.init_from to a dlmjax run or step directory.'
    )
  if r.group_size < 2:
    raise ConfigError(
      f'rl.group_size={r.group_size}: group advantages need at least 2 '
      'completions per prompt; set --config.rl.group_size=2 or more.'
    )
  if config.train.global_batch_size % r.group_size:
    raise ConfigError(
      f'rl.group_size={r.group_size} does not divide train.global_batch_size='
      f'{config.train.global_batch_size}; each rollout holds whole groups.'
    )
  for key in ('num_prompts', 'max_prompt_tokens', 'inner_updates', 'elbo_samples'):
    if r[key] < 1:
      raise ConfigError(f'rl.{key}={r[key]} must be >= 1.')
  gen_length = config.sampler.gen_length
  if r.max_prompt_tokens + gen_length > config.model.seq_len:
    raise ConfigError(
      f'rl.max_prompt_tokens + sampler.gen_length = '
      f'{r.max_prompt_tokens + gen_length} exceed model.seq_len='
      f'{config.model.seq_len}; shorten them.'
    )
  if r.kl_beta < 0 or not 0 < r.clip_eps or not 0 <= r.p_mask_prompt <= 1:
    raise ConfigError('rl.kl_beta must be >= 0, rl.clip_eps > 0 and rl.p_mask_prompt in [0, 1].')
  objective = objectives.get(r.objective)
  if not objective.kl and r.kl_beta > 0:
    raise ConfigError(
      f'rl.objective={r.objective} has no KL term (it trains without a reference), but '
      f'rl.kl_beta={r.kl_beta}; set --config.rl.kl_beta=0.'
    )
  if 'steps' in objective.records and config.sampler.edit_threshold > 0:
    raise ConfigError(
      f'rl.objective={r.objective} scores each token in the state its commit step saw, but '
      f'sampler.edit_threshold={config.sampler.edit_threshold} edits tokens after their commit; '
      'set --config.sampler.edit_threshold=0 for its rollouts.'
    )
  if r.ref_sync_every < 0 or not 0 < r.ref_sync_alpha <= 1:
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} must be >= 0 (0 = never) and '
      f'rl.ref_sync_alpha={r.ref_sync_alpha} in (0, 1].'
    )
  if r.ref_sync_every and r.kl_beta == 0:
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} refreshes the KL reference, but rl.objective='
      f'{r.objective} with rl.kl_beta=0 has no KL term; set --config.rl.ref_sync_every=0.'
    )
  if r.ref_sync_every and (config.train.lora.rank > 0 or r.reference_on_host):
    raise ConfigError(
      f'rl.ref_sync_every={r.ref_sync_every} keeps a refreshed reference in the train state, '
      'on the mesh and for a full fine-tune (with LoRA the reference is the frozen base, as in '
      'd1 under PEFT); set --config.rl.ref_sync_every=0, or train.lora.rank=0 and '
      'rl.reference_on_host=False.'
    )
  objective.check(config)
