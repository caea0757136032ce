"""wd1++ (the wd1 paper's second version, arXiv 2507.08838v2, section 3.3, Eq. 10): every decoding
step l = 1..L predicts x_0|l from its state x_l; all G x L predictions are rewarded and weighted
softmax(psi A) - softmax(-psi A) over that expanded group; each row of an update trains on one
step l ~ U{1..L}: log pi(x_0|l | x_l) over the masked tokens of x_l, times L / G (x 1 / t_l).

After the first EOS: the state x_l keeps the tokens as generated (the sampler's state), the
target x_0|l is EOS-padded after its first EOS and scored up to it.
"""

from __future__ import annotations

import numpy as np

from dlmjax.config import ConfigError
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import canvas, estimators
from dlmjax.rl.objectives import base, wd1


def stepwise_draws(seed: int, mask_seeds_B, num_steps: int):
  """wd1++'s step per row: int [B] in [0, num_steps) (step l = draw + 1), a function of the
  run's seed and the row's mask seed only, like every other RL mask draw."""
  return np.array(
    [
      np.random.default_rng([7, seed % 2**32, int(s) % 2**32]).integers(num_steps)
      for s in np.asarray(mask_seeds_B)
    ],
    np.int64,
  )


def stepwise_rows(
  prompt_BP,
  prompt_lengths_B,
  preds_BSG,
  steps_BG,
  weights_BS,
  draws_B,
  *,
  group_size: int,
  mask_id: int,
  eos_id: int,
  pad_id: int,
  dce_weight: bool = True,
):
  """wd1++'s rows for one inner update: each row's drawn step l (draws_B, 0-based), right-padded
  like canvas.to_right_padded. tokens: the state x_l, the final completion with MASK wherever
  the commit step is >= l (the sampler's state before step l); targets / completion_mask: that
  step's predicted completion x_0|l, rewritten to EOS after its first EOS, and its mask up to
  it; advantages: its signed weight (w+ - w-); weight: its loss weight G / rows (a prompt's rows
  summed, the prompts averaged) x L / G x (dce_weight: 1 / t_l, t_l = x_l's masked share of the
  canvas, which is 1 at l = 1)."""
  batch, num_steps, gen = preds_BSG.shape
  rows = np.arange(batch)
  width = prompt_BP.shape[1]
  out_BW = np.concatenate([np.asarray(prompt_BP), preds_BSG[rows, draws_B]], axis=1)
  raw, _, lengths = canvas.to_right_padded(
    out_BW, prompt_lengths_B, width, eos_id=eos_id, pad_id=pad_id, after_eos='generated'
  )
  targets, mask, _ = canvas.to_right_padded(
    out_BW, prompt_lengths_B, width, eos_id=eos_id, pad_id=pad_id
  )
  steps = canvas.steps_right_padded(steps_BG, prompt_lengths_B, raw.shape[1])
  masked = steps >= draws_B[:, None]  # -1 on the prompt and the pads: never masked
  t_B = masked.sum(axis=1) / gen
  factor = num_steps / group_size / (t_B if dce_weight else 1.0)
  weight = base.group_sum_weights(mask, group_size) * factor
  return dict(
    tokens=np.where(masked, mask_id, raw).astype(np.int32),
    targets=targets,
    lengths=lengths,
    completion_mask=mask,
    advantages=weights_BS[rows, draws_B].astype(np.float32),
    weight=weight.astype(np.float32),
  )


class WD1PP(base.Objective):
  name = 'wd1pp'
  config_keys = ('wd1pp_psi', 'wd1pp_dce_weight')
  records = ('steps', 'predictions')
  extra_batch_keys = ('targets',)
  scores = None
  kl = False

  def check(self, config):
    """wd1++ reads every step's whole-canvas prediction: the uncached sampler on a model without
    the block grid, every step committing a token (so every row runs all sampler.steps steps)."""
    s, r = config.sampler, config.rl
    if s.cache != 'none':
      raise ConfigError(
        f"rl.objective=wd1pp needs every step's whole-canvas prediction, which sampler.cache="
        f'{s.cache} does not compute: set --config.sampler.cache=none.'
      )
    if config.model.attention_mask == 'block_causal':
      raise ConfigError(
        'rl.objective=wd1pp needs a model without the block grid (its canvas can run an extra '
        'block): set model.attention_mask to bidirectional or causal.'
      )
    if s.threshold > 0 or s.factor > 0 or s.stop_at_eos or s.steps > s.gen_length:
      raise ConfigError(
        'rl.objective=wd1pp needs every sampler step to commit a token: set sampler.threshold=0, '
        'sampler.factor=0, sampler.stop_at_eos=False and sampler.steps <= sampler.gen_length.'
      )
    if not r.wd1pp_psi > 0:
      raise ConfigError(f'rl.wd1pp_psi={r.wd1pp_psi} must be > 0.')

  def describe(self, config):
    r = config.rl
    return (
      'wd1++ (wd1 v2 Eq. 10): each decoding step l = 1..L predicts x_0|l from its state '
      f'x_l; rewards of all G x L predictions ({config.sampler.steps} steps), weights '
      f'softmax(psi A) - softmax(-psi A) over them (psi={r.wd1pp_psi:g}); per row and update one '
      'l ~ U{1..L}, log pi(x_0|l | x_l) over the masked tokens of x_l from one forward; factor '
      + (
        'L / G x 1 / t_l (our reading of the garbled "L / G l": t_l = masked share of the canvas '
        'in x_l, the DCE weight)'
        if r.wd1pp_dce_weight
        else 'L / G (rl.wd1pp_dce_weight=False: no 1 / t_l)'
      )
      + ', no ratio, no KL term'
    )

  def settings(self, config):
    return dict(mask_id=config.model.mask_token_id, chunk_size=config.model.loss_chunk_tokens)

  def estimate(self, module, arrays, *, seed, settings):
    """log pi(x_0|l | x_l) [B]: tokens hold the drawn step's state x_l, targets its x_0|l."""
    del seed  # the step l is drawn on the host (stepwise_draws)
    return estimators.stepwise_logprobs(
      module,
      arrays['tokens'],
      arrays['targets'],
      arrays['completion_mask'],
      arrays['lengths'],
      **settings,
    )

  def loss(self, estimate, arrays, rl):
    del rl  # advantages: w+ - w- of x_0|l; no ratio, no KL term (the paper's beta = 0)
    return base.no_kl(wd1.sequence_loss(estimate, arrays['advantages']))

  def loss_weights(self, completion_mask_BL, *, normalisation='token', group_size=0):
    """wd1's (stepwise_rows multiplies them by L / G / t_l)."""
    return wd1.OBJECTIVE.loss_weights(
      completion_mask_BL, normalisation=normalisation, group_size=group_size
    )

  def scored_completions(self, prompt_BP, out_BW, recorded):
    """Every step's prediction, rows b * L + l: the prompt beside each x_0|l."""
    preds = recorded['predictions']
    rows, num_steps = preds.shape[:2]
    return np.concatenate(
      [np.repeat(prompt_BP, num_steps, axis=0), preds.reshape(rows * num_steps, -1)], axis=1
    )

  def advantages(self, rewards, group_size, rl=None):
    """[B, L]: the weights over each prompt's G x L predictions (rewards [B, L])."""
    return advantages_lib.wd1pp_weights(rewards, group_size, rl.wd1pp_psi)

  def outcomes(self, rewards_BS, correct_BS, group_size, rl):
    """The rows' rewards, correctness and weights are those of x_0|L, the completion; the
    updates' rows read every step's weight."""
    weights_BS = self.advantages(rewards_BS, group_size, rl)
    extra = dict(rollout_step_reward_mean=float(rewards_BS.mean()))
    return rewards_BS[:, -1], correct_BS[:, -1], weights_BS[:, -1], weights_BS, extra

  def update_rows(self, config, prompt_BP, prompt_lengths_B, recorded, weights_BS, seeds_B):
    """Each row's drawn step of this update (stepwise_rows)."""
    m, preds = config.model, recorded['predictions']
    return stepwise_rows(
      prompt_BP,
      prompt_lengths_B,
      preds,
      recorded['steps'],
      weights_BS,
      stepwise_draws(config.seed, seeds_B, preds.shape[1]),
      group_size=config.rl.group_size,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      dce_weight=config.rl.wd1pp_dce_weight,
    )


OBJECTIVE = WD1PP()
