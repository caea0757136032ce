"""TraceRL (arXiv 2509.06949; Gen-Verse/dLLM-RL train/rl_sdar.py): each token scored in the state
the sampler committed it in (block-causal models), d1's clipped ratio and k3 KL on top.

The rollout records each token's commit step (the batch's `steps`); the estimate draws no masks,
so one old / reference estimate serves every inner update. After the first EOS: the rows stay
EOS-padded (tokens committed there are the later states' context).
"""

from __future__ import annotations

from dlmjax.config import ConfigError
from dlmjax.diffusion import sampling_config
from dlmjax.rl import estimators
from dlmjax.rl.objectives import base, d1


def rounds(config) -> int:
  """TraceRL's rounds per model block: a block holds at most min(block_size, steps per block)
  distinct commit steps."""
  sampling = sampling_config.SamplingConfig.from_config(config)
  return min(config.model.block_size, sampling.steps_per_block)


class Trace(base.Objective):
  name = 'trace'
  config_keys = ('clip_eps', 'kl_beta', 'ref_sync_every', 'ref_sync_alpha')
  records = ('steps',)
  extra_batch_keys = ('steps',)
  draws_masks = False

  def check(self, config):
    m = config.model
    if (
      m.attention_mask != 'block_causal'
      or m.shift_logits
      or config.sampler.block_length != m.block_size
    ):
      raise ConfigError(
        'rl.objective=trace scores each token in the state the sampler committed it in, one '
        'model block at a time: set --config.model.attention_mask=block_causal, '
        f'model.shift_logits=false and sampler.block_length=model.block_size ({m.block_size}).'
      )

  def describe(self, config):
    r = config.rl
    return (
      "TraceRL's trajectory estimate (each token under the state the sampler committed it in, "
      f'per block), group-mean advantages, clip_eps={r.clip_eps:g}, {base.kl_text(r)}'
    )

  def settings(self, config):
    return dict(
      mask_id=config.model.mask_token_id,
      chunk_size=config.model.loss_chunk_tokens,
      block_size=config.model.block_size,
      rounds=rounds(config),
    )

  def estimate(self, module, arrays, *, seed, settings):
    del seed  # the states are the trajectory's
    return estimators.trace_token_logprobs(
      module,
      arrays['tokens'],
      arrays['prompt_lengths'],
      arrays['lengths'],
      arrays['steps'],
      **settings,
    )

  def loss(self, estimate, arrays, rl):
    return d1.OBJECTIVE.loss(estimate, arrays, rl)


OBJECTIVE = Trace()
