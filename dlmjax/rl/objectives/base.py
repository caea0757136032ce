"""What an RL objective declares, and the pieces several objectives share.

An objective is one module of this package holding one `Objective`: what the rollout records,
the batch's arrays, the advantages, the loss weights, ONE estimator (the loss trains with it and
the rollout scores the old and reference policies with it, so the two can never disagree), the
loss on that estimate, the config keys it reads, what it scores after a completion's first EOS,
and its one-line description. The rollout, the RL stage and the held-out evaluation read these
declarations and never ask which objective runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from dlmjax.rl import advantages as advantages_lib

# The arrays of every RL batch (rows right-padded: prompt, completion canvas, pads).
BATCH_KEYS = (
  'tokens',
  'prompt_lengths',
  'lengths',
  'mask_seeds',
  'advantages',
  'old',
  'ref',
  'weight',
  'completion_mask',
  'rewards',
)
# What a completion's canvas holds after its first EOS when the objective scores it: 'eos', each
# position rewritten to EOS (LLaDA's SFT rows pad the answer with EOS); 'generated', the tokens as
# the sampler left them.
AFTER_EOS = ('eos', 'generated')


class Objective:
  """One RL objective; the defaults are diffu-GRPO's (d1): a per-token estimate with a clipped
  ratio and a KL term, group-mean advantages, token-normalised weights.

  name: the rl.objective value.
  config_keys: the rl.* keys the objective reads beyond the stage's own (printed by describe).
  records: what the sampler records beside the tokens: 'steps' (each token's commit step),
    'predictions' (every step's predicted completion, with the steps).
  extra_batch_keys: arrays the batch carries beyond BATCH_KEYS.
  scores: the old / reference estimates the rollout scores: 'token' ([B, L]), 'sequence' ([B]),
    or None (no ratio and no KL term: nothing is scored, the arrays are zeros [B]).
  draws_masks: the estimate draws masks from the rows' mask seeds (a fresh draw each inner
    update); False: one estimate serves every inner update (TraceRL's trajectory states).
  after_eos: one of AFTER_EOS, following the objective's paper (docs: RL objectives).
  """

  name: str = ''
  config_keys: tuple[str, ...] = ()
  records: tuple[str, ...] = ()
  extra_batch_keys: tuple[str, ...] = ()
  scores: str | None = 'token'
  draws_masks: bool = True
  after_eos: str = 'eos'
  kl: bool = True  # the loss has a KL term against a reference (rl.kl_beta)

  @property
  def batch_keys(self) -> tuple[str, ...]:
    return BATCH_KEYS + self.extra_batch_keys

  def describe(self, config) -> str:
    """The objective's switches and values in one line (after `rl.objective=NAME: `)."""
    raise NotImplementedError

  def check(self, config) -> None:
    """Raises ConfigError for a config this objective cannot train (the stage's shared checks
    run first, in rl/config_checks.py); none by default."""

  def settings(self, config) -> dict:
    """The estimator's static settings (hashable values: one compiled scorer per distinct set)."""
    return dict(
      mask_id=config.model.mask_token_id,
      chunk_size=config.model.loss_chunk_tokens,
      p_mask_prompt=config.rl.p_mask_prompt,
    )

  def estimate(self, module, arrays: Mapping, *, seed, settings: dict):
    """The objective's log-likelihood estimate of the batch's completions under `module`: what
    the loss trains and what the rollout scores the old / reference policies with. `arrays`
    holds tokens, prompt_lengths, lengths, mask_seeds and the extra batch keys; `seed` is the
    run's seed or its key."""
    raise NotImplementedError

  def loss(self, estimate, arrays: Mapping, rl) -> tuple:
    """(loss, kl, clipped) per unit (token [B, L] or sequence [B]) from the estimate, the
    batch's arrays (advantages, old, ref, completion_mask, ...) and the rl config group."""
    raise NotImplementedError

  def advantages(self, rewards, group_size: int, rl=None):
    """What each scored completion's loss multiplies: group-mean advantages."""
    del rl
    return advantages_lib.group_advantages(rewards, group_size)

  def loss_weights(self, completion_mask_BL, *, normalisation: str = 'token', group_size=0):
    """Each unit's share of the global batch loss: per token, mask / the global batch's
    completion tokens ('token', DAPO's token mean; d1 takes it per micro-batch of 6 rows and
    averages the micro-batches, the same with equal lengths), or mask / (the row's tokens x rows)
    ('sequence', GRPO)."""
    del group_size
    return token_weights(completion_mask_BL, normalisation)

  # The rollout's hooks. The defaults score the final completions; wd1++ scores every step's.

  def scored_completions(self, prompt_BP, out_BW, recorded: Mapping):
    """The sampler rows whose texts the task rewards (default: the completions, one per row)."""
    del prompt_BP, recorded
    return out_BW

  def outcomes(self, rewards_BS, correct_BS, group_size: int, rl):
    """(rewards [B], correct [B], advantages [B], what update_rows reads, metrics) of the batch's
    rows from the rewards and correctness of the scored completions, [B, S] (S per row)."""
    rewards_B = rewards_BS[:, 0]
    return rewards_B, correct_BS[:, 0], self.advantages(rewards_B, group_size, rl), None, {}

  def update_rows(self, config, prompt_BP, prompt_lengths_B, recorded, per_update, seeds_B):
    """Arrays that replace the batch's for the inner update with mask seeds seeds_B (None: the
    batch serves as it is); per_update is what outcomes returned for it."""
    del config, prompt_BP, prompt_lengths_B, recorded, per_update, seeds_B
    return None


def token_weights(completion_mask_BL, normalisation: str = 'token'):
  """Objective.loss_weights's per-token rule."""
  rows = completion_mask_BL.shape[0]
  if normalisation == 'token':
    return (completion_mask_BL / max(completion_mask_BL.sum(), 1.0)).astype(np.float32)
  per_row = np.maximum(completion_mask_BL.sum(axis=1, keepdims=True), 1.0)
  return (completion_mask_BL / per_row / rows).astype(np.float32)


def group_sum_weights(completion_mask_BL, group_size: int):
  """G / rows per sequence: a group's rows summed, the groups averaged (wd1's loss is the sum
  over a micro-batch of one group, averaged over micro-batches)."""
  if group_size < 2:
    raise ValueError('wd1 loss weights need the group size (group_size=rl.group_size).')
  rows = completion_mask_BL.shape[0]
  return np.full((rows,), group_size / rows, np.float32)


def kl_text(rl, kind: str = 'k3') -> str:
  """The KL term's switches for a description line."""
  if rl.kl_beta <= 0:
    return 'no KL term'
  sync = (
    f', reference refreshed every {rl.ref_sync_every} steps with alpha={rl.ref_sync_alpha:g})'
    if rl.ref_sync_every
    else ', frozen init reference)'
  )
  return f'kl_beta={rl.kl_beta:g} ({kind}' + sync


def no_kl(loss):
  """(loss, kl, clipped) of an objective without a ratio or a KL term."""
  kl = clipped = jnp.zeros_like(loss)
  return loss, kl, clipped


def clipped_surrogate(ratio, advantage, eps: float):
  """-min(rho A, clip(rho, 1-eps, 1+eps) A) and whether the clip is active: the clipped term is
  the smaller, so the unit gets no policy gradient (rho > 1+eps with A > 0, or rho < 1-eps with
  A < 0; PPO's clip fraction). TRL's and d1's `clip_ratio` (rho A < clip(rho) A) counts the
  opposite side, where rho left the range but the unclipped term is kept."""
  unclipped = ratio * advantage
  clipped = jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * advantage
  is_clipped = ((ratio < 1.0 - eps) & (advantage < 0)) | ((ratio > 1.0 + eps) & (advantage > 0))
  return -jnp.minimum(unclipped, clipped), is_clipped


def k3(logp, ref_logp):
  """Schulman's k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


def k2(elbo, ref_elbo):
  """ESPO's k2 KL of the sequence: (ELBO - ELBO_ref)^2 / 2."""
  return 0.5 * jnp.square(elbo - ref_elbo)
