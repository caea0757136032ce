"""The RL no-signal line: said once per streak of rollouts whose rewards were all equal."""

import numpy as np

from dlmjax.rl import rollout
from tests.conftest import tiny_test_config


def _lines(rewards_per_rollout, temperature=0.9):
  config = tiny_test_config()
  config.sampler.temperature = temperature
  watch = rollout.NoSignalWatch(config)
  return [watch.observe(np.asarray(r, np.float32)) for r in rewards_per_rollout]


def test_said_once_when_every_reward_of_the_last_rollouts_was_equal():
  equal, mixed = [0.0] * 8, [0.0] * 7 + [1.0]
  n = rollout.NO_SIGNAL_ROLLOUTS
  lines = _lines([equal] * (n - 1) + [mixed] + [equal] * (2 * n) + [[0.5] * 8])
  said = [i for i, line in enumerate(lines) if line is not None]
  assert said == [2 * n - 1]  # after n equal rollouts in a row (the mixed one restarts the count)
  assert lines[said[0]].startswith(
    f'no reward signal: every reward of the last {n} rollouts was 0 '
  )
  assert 'init_from' in lines[said[0]] and '\n' not in lines[said[0]]


def test_equal_rewards_at_another_value_and_greedy_rollouts_name_their_fix():
  lines = _lines([[1.0] * 4] * rollout.NO_SIGNAL_ROLLOUTS, temperature=0.0)
  assert lines[:-1] == [None] * (rollout.NO_SIGNAL_ROLLOUTS - 1)
  assert 'was 1 ' in lines[-1] and '--config.sampler.temperature' in lines[-1]
  assert _lines([[1.0, 0.1, 1.0, 1.0]] * 5) == [None] * 5  # any spread is a signal
