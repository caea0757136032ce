"""RL losses, advantages and batch layout against hand-written numpy formulas."""

import pathlib
import re

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.rl import advantages, canvas, objectives
from dlmjax.rl.objectives import base, d1, espo, spg, wd1


def _np_d1(logp, old, ref, adv, mask, eps, beta):
  """d1 diffu_grpo_trainer: per-token clipped GRPO + beta k3, a token mean over the batch (DAPO's;
  d1 takes it per micro-batch, the same here as the test has one)."""
  ratio = np.exp(logp - old)
  a = adv[:, None]
  per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)
  kl = np.exp(ref - logp) - (ref - logp) - 1
  return ((per_token + beta * kl) * mask).sum() / mask.sum()


def test_d1_token_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logp, old, ref = (rng.normal(-2, 0.7, (6, 9)).astype(np.float32) for _ in range(3))
  adv = rng.normal(size=6).astype(np.float32)
  mask = (rng.random((6, 9)) < 0.7).astype(np.float32)
  loss, kl, clipped = d1.token_loss(logp, old, ref, adv, eps=0.2, beta=0.04)
  weight = d1.OBJECTIVE.loss_weights(mask, normalisation='token')
  assert float((np.asarray(loss) * weight).sum()) == pytest.approx(
    _np_d1(logp, old, ref, adv, mask, 0.2, 0.04), rel=1e-5
  )
  ratio = np.exp(logp - old)
  expect_clipped = ((ratio < 0.8) & (adv[:, None] < 0)) | ((ratio > 1.2) & (adv[:, None] > 0))
  np.testing.assert_array_equal(np.asarray(clipped), expect_clipped)
  np.testing.assert_allclose(kl, np.exp(ref - logp) - (ref - logp) - 1, rtol=1e-5, atol=1e-6)
  # Sequence normalisation (GRPO): mean over each row's tokens, then over rows.
  per_token = np.asarray(loss)
  expected = np.mean([(per_token[b] * mask[b]).sum() / mask[b].sum() for b in range(6)])
  assert float(
    (per_token * d1.OBJECTIVE.loss_weights(mask, normalisation='sequence')).sum()
  ) == pytest.approx(expected, rel=1e-5)


def test_clip_fraction_counts_the_units_the_clip_silences():
  """rho out of [1-eps, 1+eps] on the side where the clipped term is the min (no gradient)."""
  ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.1], np.float32)
  advantage = np.array([1.0, -1.0, 1.0, -1.0, 1.0], np.float32)
  _, clipped = base.clipped_surrogate(ratio, advantage, 0.2)
  # TRL's and d1's clip_ratio (rho A < clip(rho) A) would give [F, T, T, F, F] instead.
  assert np.asarray(clipped).tolist() == [True, False, False, True, False]


def test_espo_sequence_loss_matches_numpy():
  rng = np.random.default_rng(1)
  elbo, old, ref = (rng.normal(-30, 3, 5).astype(np.float32) for _ in range(3))
  adv = rng.normal(size=5).astype(np.float32)
  length = rng.integers(5, 20, 5).astype(np.float32)
  loss, kl, _ = espo.sequence_loss(elbo, old, ref, adv, length, eps=0.2, beta=0.1)
  ratio = np.exp((elbo - old) / length)
  expected = (
    -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv) + 0.1 * 0.5 * (elbo - ref) ** 2
  )
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(kl, 0.5 * (elbo - ref) ** 2, rtol=1e-5)


def test_spg_sequence_loss_matches_numpy():
  rng = np.random.default_rng(2)
  elbo, eubo = rng.normal(-3, 1, 6).astype(np.float32), rng.normal(-2, 1, 6).astype(np.float32)
  adv = np.array([0.5, -0.5, 0.0, 0.25, -0.25, 1.0], np.float32)
  loss = spg.sequence_loss(elbo, eubo, adv, mix_weight=0.3)
  bound = np.where(adv > 0, elbo, 0.3 * eubo + 0.7 * elbo)  # A > 0: ELBO; otherwise the mix
  np.testing.assert_allclose(loss, -adv * bound, rtol=1e-6)


def test_ratio_one_gives_the_policy_gradient_sign():
  zero = np.zeros((2, 3), np.float32)
  loss, _, clipped = d1.token_loss(
    zero, zero, zero, np.array([1.0, -2.0], np.float32), eps=0.5, beta=0.3
  )
  np.testing.assert_allclose(loss, [[-1.0] * 3, [2.0] * 3])
  assert not np.asarray(clipped).any()


def test_group_advantages():
  rewards = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0, 4.0])
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 4), [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -2.0, 2.0]
  )
  groups = rewards.reshape(2, 4)
  expected = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 4, 'std'), expected.reshape(-1), rtol=1e-5
  )
  with pytest.raises(ValueError, match='at least|two'):
    advantages.group_advantages(rewards, 1)
  with pytest.raises(ValueError, match='groups of 3'):
    advantages.group_advantages(rewards, 3)


def test_dropped_negative_advantages_keep_only_above_average_rows():
  rewards = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0, 4.0])
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 4, negatives='drop'),
    [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
  )
  scaled = advantages.group_advantages(rewards, 4, 'std', negatives='drop')
  np.testing.assert_allclose(scaled, np.maximum(advantages.group_advantages(rewards, 4, 'std'), 0))
  with pytest.raises(ValueError, match='keep.*drop'):
    advantages.group_advantages(rewards, 4, negatives='clip')


def test_score_counts_failing_reward_functions():
  def reward(example, completion):
    if completion == 'boom':
      raise RuntimeError('bad reward code')
    return float('nan') if completion == 'nan' else len(completion)

  rewards, failures = advantages.score(reward, [None] * 4, ['ab', 'boom', 'nan', 'abc'])
  np.testing.assert_array_equal(rewards, [2, 0, 0, 3])
  assert failures == 2


def test_to_right_padded_layout():
  pad, eos = 0, 2
  out = np.array(
    [
      [0, 0, 5, 6, 7, 2, 9, 9],  # prompt [5, 6], completion [7, EOS] then junk
      [4, 5, 6, 7, 8, 9, 9, 9],
    ]
  )  # prompt [4, 5, 6, 7], no EOS
  tokens, mask, lengths = canvas.to_right_padded(out, np.array([2, 4]), 4, eos_id=eos, pad_id=pad)
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 2, 2, 2, 0, 0], [4, 5, 6, 7, 8, 9, 9, 9]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]])
  np.testing.assert_array_equal(lengths, [6, 8])
  # TraceRL's commit steps [B, gen] land on the same canvas, -1 on the prompt and the pads.
  steps = canvas.steps_right_padded(np.array([[3, 0, 1, -1], [0, 0, 2, 1]]), [2, 4], 8)
  np.testing.assert_array_equal(steps, [[-1, -1, 3, 0, 1, -1, -1, -1], [-1] * 4 + [0, 0, 2, 1]])
  assert objectives.get('trace').batch_keys == base.BATCH_KEYS + ('steps',)
  assert objectives.get('d1').batch_keys == base.BATCH_KEYS


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def test_wd1_loss_matches_numpy():
  """wd1 (rev_grpo_trainer.py): per group -sum_i softmax(A)_i S_i + sum_i softmax(-A)_i S_i, S_i the
  summed completion log-probs, averaged over the groups (one group per micro-batch there)."""
  rng = np.random.default_rng(3)
  group, rows = 3, 6
  rewards = np.array([1.0, 0.0, 0.25, 2.0, 2.0, 0.5], np.float32)
  logp = rng.normal(-2, 0.7, (rows, 7)).astype(np.float32)
  mask = (rng.random((rows, 7)) < 0.8).astype(np.float32)
  seq = (logp * mask).sum(1)
  weights = wd1.OBJECTIVE.advantages(rewards, group)
  loss = wd1.sequence_loss(seq, weights)
  total = float((np.asarray(loss) * wd1.OBJECTIVE.loss_weights(mask, group_size=group)).sum())
  expected = []
  for g in range(rows // group):
    r = rewards[g * group : (g + 1) * group].astype(np.float64)
    a, s = r - r.mean(), seq[g * group : (g + 1) * group]
    expected.append(-(_softmax(a) * s).sum() + (_softmax(-a) * s).sum())
  assert total == pytest.approx(np.mean(expected), rel=1e-5)
  np.testing.assert_allclose(weights.reshape(2, 3).sum(1), 0.0, atol=1e-6)  # each group sums to 0
  with pytest.raises(ValueError, match='group size'):
    wd1.OBJECTIVE.loss_weights(mask)


def test_leave_one_out_advantages_match_numpy():
  """DiffuCoder's coupled-GRPO baseline: r_i minus the mean of the group's other rewards."""
  rewards = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0, 4.0])
  expected = [r - (np.sum(g) - r) / 3 for g in rewards.reshape(2, 4) for r in g]
  np.testing.assert_allclose(
    objectives.get('coupled_grpo').advantages(rewards, 4), expected, rtol=1e-6
  )
  # = G / (G - 1) x the mean-baseline advantage
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 4, baseline='leave_one_out'),
    advantages.group_advantages(rewards, 4) * 4 / 3,
    rtol=1e-6,
  )
  with pytest.raises(ValueError, match='baseline'):
    advantages.group_advantages(rewards, 4, baseline='median')


def test_objective_switches_are_one_logged_line():
  from tests.conftest import tiny_test_config  # pylint: disable=import-outside-toplevel

  for name, beta in [('wd1', 0.0), ('wd1pp', 0.0), ('coupled_grpo', 0.01)]:
    c = tiny_test_config(**{'rl.objective': name, 'rl.kl_beta': beta, 'rl.ref_sync_every': 0})
    line = objectives.describe(c)
    assert line.startswith(f'rl.objective={name}: ') and '\n' not in line
  assert 'leave-one-out' in line and 'U[0.2, 0.8]' in line and 'kl_beta=0.01' in line


def test_the_config_choices_are_the_registry():
  assert config_lib.registered_choices()['rl.objective'] == objectives.names()
  with pytest.raises(ValueError, match="rl.objective='ppo' is not one of"):
    objectives.get('ppo')


def test_rl_and_train_dispatch_on_declarations_not_names():
  """Objectives are read through their declarations (rl/objectives/) and stages through their
  Stage (train/stages/): no module of rl/ or train/ elsewhere compares an objective's name or
  tests config.stage, so an objective is one module and its registry line."""
  root = pathlib.Path(__file__).resolve().parents[2] / 'dlmjax'
  by_name = re.compile(r"(?<!diffusion\.)objective\s*(==|!=)\s*'|objective\s+(not\s+)?in\s*\(")
  found = []
  for folder in ('rl', 'train'):
    for path in sorted((root / folder).rglob('*.py')):
      rel = path.relative_to(root).as_posix()
      text = path.read_text()
      if not rel.startswith('rl/objectives/') and by_name.search(text):
        found.append(rel)
      if not rel.startswith('train/stages/') and 'config.stage' in text:
        found.append(rel)
  assert not found
