"""Group-relative advantages (GRPO): each completion's reward against its prompt's group.

Peers disagree on the scaling (dlm_peers.md 2.10): d1, SPG and ESPO subtract the group mean only
('none'); dLLM-RL divides by the group's population std ('std'). Both are a config switch. The
baseline is the group mean, or (DiffuCoder's coupled-GRPO) the mean of the other G - 1 rewards.
wd1 turns the advantages into ratio-free weights (wd1_weights).
"""

from __future__ import annotations

import numpy as np

SCALINGS = ('none', 'std')
NEGATIVES = ('keep', 'drop')
BASELINES = ('mean', 'leave_one_out')


def group_advantages(
  rewards_B,
  group_size: int,
  scaling: str = 'none',
  eps: float = 1e-4,
  negatives: str = 'keep',
  baseline: str = 'mean',
):
  """A_i = r_i - mean(group) [/ (std(group) + eps)]; rows i*G .. i*G+G-1 share a prompt.

  baseline='leave_one_out' (RLOO, DiffuCoder's coupled_grpo.py): A_i = r_i - mean_{j != i} r_j,
  which is G / (G - 1) times the mean-baseline advantage; the std scaling then uses the group's
  sample std, as DiffuCoder's (torch's default unbiased std).

  negatives='drop' zeroes the below-average rows (max(A, 0)): the update then only raises the
  likelihood of completions that beat their group, like fine-tuning on them, and never pushes
  down sampled tokens, whose low probabilities make that push the unstable part at high lr."""
  rewards_B = np.asarray(rewards_B, np.float64)
  if group_size < 2:
    raise ValueError(f'group size {group_size} < 2: a group needs two completions to compare.')
  if rewards_B.shape[0] % group_size:
    raise ValueError(f'{rewards_B.shape[0]} rewards do not split into groups of {group_size}.')
  if scaling not in SCALINGS:
    raise ValueError(f'advantage scaling {scaling!r} is not one of {SCALINGS}.')
  if negatives not in NEGATIVES:
    raise ValueError(f'negative advantages {negatives!r}: choose one of {NEGATIVES}.')
  if baseline not in BASELINES:
    raise ValueError(f'advantage baseline {baseline!r}: choose one of {BASELINES}.')
  groups = rewards_B.reshape(-1, group_size)
  if baseline == 'leave_one_out':
    others = (groups.sum(axis=1, keepdims=True) - groups) / (group_size - 1)
    advantages, ddof = groups - others, 1
  else:
    advantages, ddof = groups - groups.mean(axis=1, keepdims=True), 0
  if scaling == 'std':
    advantages = advantages / (groups.std(axis=1, ddof=ddof, keepdims=True) + eps)
  if negatives == 'drop':
    advantages = np.maximum(advantages, 0.0)
  return advantages.reshape(-1).astype(np.float32)


def wd1_weights(advantages_B, group_size: int):
  """wd1's signed completion weights w+_i - w-_i, w+ = softmax(A) and w- = softmax(-A) over each
  group (xiaohangt/wd1, wd1/trainers/rev_grpo_trainer.py compute_loss: the softmax runs over the
  6 rows of a device's micro-batch, which in its train.yaml are one prompt's G = 6). Each group's
  weights sum to 0: positive for above-average completions, negative below."""
  groups = np.asarray(advantages_B, np.float64).reshape(-1, group_size)

  def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

  return (softmax(groups) - softmax(-groups)).reshape(-1).astype(np.float32)


def wd1pp_weights(rewards_BS, group_size: int, psi: float = 1.0):
  """wd1++'s signed weights (w+ - w-) [B, S] of every step's predicted completion x_0|l (wd1
  paper v2, arXiv 2507.08838v2, section 3.3, Eq. 10 with Eq. 9's weights): rows i*G .. i*G+G-1
  share a prompt, and its group is expanded to the G x S predictions; A = R - the mean of those
  G x S rewards, w+ = softmax(psi A) and w- = softmax(-psi A) over them. Each prompt's G x S
  weights sum to 0."""
  rewards = np.asarray(rewards_BS, np.float64)
  rows, steps = rewards.shape
  if group_size < 2 or rows % group_size:
    raise ValueError(f'{rows} rows do not split into groups of {group_size} >= 2.')
  groups = rewards.reshape(rows // group_size, group_size * steps)
  advantages = psi * (groups - groups.mean(axis=1, keepdims=True))

  def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

  return (softmax(advantages) - softmax(-advantages)).reshape(rows, steps).astype(np.float32)


def score(reward_fn, examples, completions):
  """(rewards [B] float32, failures): a reward fn that raises or returns a non-number scores 0
  and is counted, never a crash."""
  rewards, failures = np.zeros(len(completions), np.float32), 0
  for i, (example, completion) in enumerate(zip(examples, completions)):
    try:
      value = float(reward_fn(example, completion))
      if not np.isfinite(value):
        raise ValueError('non-finite reward')
      rewards[i] = value
    except Exception:  # pylint: disable=broad-except  # user reward code: count, never crash
      failures += 1
  return rewards, failures
