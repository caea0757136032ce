"""The reward model: Bradley-Terry against the formula, transformers' pooling rule written out,
and RL against a learned reward (rl.reward_model): a rollout's rewards are the reward model's
scores of its completions, and an RL step trains on them."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax import tasks
from dlmjax.checkpoint import params_checkpoint
from dlmjax.diffusion import prompt_rows
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import objectives, reward_model, rollout
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config

ROWS, PROMPT, GEN, EOS, WIDTH = 4, 4, 8, 2, 16


def test_bradley_terry_is_the_formula():
  chosen, rejected = jnp.array([1.5, -0.25, 0.0]), jnp.array([0.5, 2.0, 0.0])
  loss, margin = reward_model.bradley_terry(chosen, rejected)
  by_hand = [math.log(1 + math.exp(-(c - r))) for c, r in zip([1.5, -0.25, 0.0], [0.5, 2.0, 0.0])]
  np.testing.assert_allclose(loss, by_hand, rtol=1e-6)
  np.testing.assert_allclose(margin, [1.0, -2.25, 0.0])


def _reward_params(config, seed=0):
  cfg = model_lib.ModelConfig.from_config(config)
  assert cfg.score_head
  params = model_lib.init_params(cfg, jax.random.key(seed))
  rng = np.random.default_rng(seed)  # a head and norms far from their init, so positions differ
  return cfg, jax.tree.map(lambda x: np.asarray(x + 0.3 * rng.standard_normal(x.shape)), params)


def test_the_score_reads_the_last_token_that_is_not_padding():
  """transformers' rule: the rightmost position whose id is not the pad id (EOS here), so an EOS
  inside a row is not where the row ends; a row with no padding is read at its last position."""
  c = tiny_test_config(stage='reward', init_from='unused')
  cfg, params = _reward_params(c)
  rng = np.random.default_rng(1)
  rows = rng.integers(3, 60, size=(3, 12)).astype(np.int32)
  rows[0, 7:] = EOS
  rows[1, 3] = EOS  # an EOS inside the response, padding after position 9
  rows[1, 10:] = EOS
  module = model_lib.merge(cfg, params)
  got = jax.jit(lambda t: module.scores(t, EOS))(rows)
  hidden = np.asarray(jax.jit(module.hidden)(rows))
  last = [6, 9, 11]
  want = [hidden[b, i] @ np.asarray(params['score'])[:, 0] for b, i in enumerate(last)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


SAMPLER_STEPS = 4


class _FixedSampler:
  """The rollout sampler's interface over one fixed output whose completions all differ; with an
  objective's records, each token's commit step and every step's prediction (the completion)."""

  def __init__(self, pad_id, records=(), one_a_step=False):
    self.pad_id, self.records, self.one_a_step = pad_id, records, one_a_step

  def pad(self, token_ids):
    return prompt_rows.pad_prompts(token_ids, self.pad_id, width=PROMPT)

  def generate(self, params, prompt_BP, prompt_lengths_B, key):
    del params, prompt_lengths_B, key
    canvas = np.array(
      [
        [7, 8, EOS, 9, 9, 9, 9, 9],  # junk after the first EOS: the reward model sees EOS
        [7, 9, 10, 11, EOS, EOS, EOS, EOS],
        [12, 13, 14, 15, 16, 17, 18, 19],  # no EOS: the whole canvas
        [20, EOS, EOS, EOS, EOS, EOS, EOS, EOS],
      ],
      np.int32,
    )
    out = np.concatenate([prompt_BP, canvas], axis=1)
    if not self.records:
      return out
    # TraceRL decodes one model block after another, a token a step (sampler.steps = GEN).
    steps = np.arange(GEN, dtype=np.int32) % (GEN if self.one_a_step else SAMPLER_STEPS)
    steps = np.tile(steps, (ROWS, 1))
    if 'predictions' not in self.records:
      return out, steps
    return out, steps, np.repeat(canvas[:, None], SAMPLER_STEPS, axis=1)

  def texts(self, out_BW):
    return ['<answer>1+1</answer>'] * len(out_BW)


@pytest.fixture(scope='module')
def reward_dir(tmp_path_factory):
  """A reward model of canvas WIDTH (wider than the RL rows) saved as a params-only run."""
  out = str(tmp_path_factory.mktemp('reward'))
  c = tiny_test_config(
    **{'stage': 'reward', 'init_from': 'unused', 'model.seq_len': WIDTH, 'output_dir': out}
  )
  cfg, params = _reward_params(c, seed=3)
  params_checkpoint.save_params_checkpoint(out, c, params)
  return out, cfg, params


def _rl_config(reward_path, objective='d1'):
  # TraceRL's policy is block-causal, decoded one model block at a time (the reward model is not).
  trace = objective == 'trace'
  block = {'model.attention_mask': 'block_causal', 'model.block_size': 4} if trace else {}
  return tiny_test_config(
    **{
      'stage': 'rl',
      'rl.objective': objective,
      'sampler.steps': GEN if trace else SAMPLER_STEPS,
      'rl.kl_beta': 0.0,
      'rl.reward_model': reward_path,
      'model.seq_len': PROMPT + GEN,
      'train.global_batch_size': ROWS,
      'train.micro_batch_size': ROWS,
      'rl.group_size': 2,
      'rl.max_prompt_tokens': PROMPT,
      'sampler.gen_length': GEN,
      'sampler.block_length': 4 if trace else GEN,
      'rl.inner_updates': 1,
      'train.schedule': 'constant',
      'train.warmup_steps': 0,
      'init_from': 'unused: the params are made here',
      **block,
    }
  )


def _rollout(reward_path, objective):
  """(config, setup, state, the first batch, its rollout row) of a rollout over _FixedSampler."""
  c = _rl_config(reward_path, objective)
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
  state = setup.init_state(0)
  task = tasks.get_task('countdown3')
  prompts = types.SimpleNamespace(
    training=types.SimpleNamespace(
      examples=[task.examples('train', 1, seed=0)[0]], token_ids=[[5, 6, 30]]
    ),
    task=task,
  )
  records = objectives.get(objective).records
  sampler = _FixedSampler(c.model.pad_token_id, records, one_a_step=objective == 'trace')
  batch, row = rollout.RolloutBatches(c, setup, prompts, sampler).next(state['params'])
  return c, setup, state, batch, row


@pytest.fixture(scope='module')
def direct_scores(reward_dir):
  """The reward model's scores of its own rows, written out: prompt, completion up to its first
  EOS, EOS to the reward model's canvas."""
  _, reward_cfg, reward_params = reward_dir
  completions = [[7, 8], [7, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]
  rows = np.full((ROWS, WIDTH), EOS, np.int32)
  for b, completion in enumerate(completions):
    rows[b, : 3 + len(completion)] = [5, 6, 30, *completion]
  module = model_lib.merge(reward_cfg, jax.tree.map(jnp.asarray, reward_params))
  scores = np.asarray(jax.jit(lambda t: module.scores(t, EOS))(rows))
  assert len(set(np.round(scores, 4))) == ROWS  # the rows' scores differ
  return scores


@pytest.mark.parametrize(
  'objective', ['d1', 'espo', 'spg', 'wd1', 'wd1pp', 'coupled_grpo', 'trace']
)
def test_rl_rewards_are_the_reward_models_scores(reward_dir, direct_scores, objective):
  """Whatever rows an objective rewards (wd1++: every step's prediction, here the completion)."""
  _, _, _, batch, row = _rollout(reward_dir[0], objective)
  np.testing.assert_allclose(batch['rewards'], direct_scores, rtol=1e-5, atol=1e-6)
  assert row['rollout_reward_mean'] == pytest.approx(float(direct_scores.mean()), rel=1e-5)


@pytest.mark.parametrize('objective', ['d1', 'trace'])  # TraceRL: a block-causal policy
def test_an_rl_step_trains_on_the_reward_models_scores(reward_dir, direct_scores, objective):
  c, setup, state, batch, _ = _rollout(reward_dir[0], objective)
  # Group advantages from those scores (groups of 2), and a step trains on them.
  np.testing.assert_allclose(batch['advantages'][0], -batch['advantages'][1], rtol=1e-5)
  assert np.sign(batch['advantages'][0]) == np.sign(direct_scores[0] - direct_scores[1])
  step = step_lib.CompiledStep(setup, stages.build(c))
  before = jax.device_get(state['params'])  # the step donates the state
  new_state, metrics = step(
    state, {k: jax.device_put(batch[k], step.batch_sharding) for k in stages.build(c).batch_keys}
  )
  assert np.isfinite(float(metrics['loss'])) and float(metrics['skipped']) == 0.0
  after = jax.device_get(new_state['params'])
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), after, before)
  assert max(jax.tree.leaves(moved)) > 0


def test_a_language_model_is_no_reward_model(tmp_path):
  c = tiny_test_config(**{'output_dir': str(tmp_path)})
  cfg = model_lib.ModelConfig.from_config(c)
  params_checkpoint.save_params_checkpoint(
    str(tmp_path), c, model_lib.init_params(cfg, jax.random.key(0))
  )
  with pytest.raises(ValueError, match='not a reward model; set it to the run directory'):
    reward_model.RewardModel(str(tmp_path))
  with pytest.raises(ValueError, match='is not a directory'):
    reward_model.RewardModel(str(tmp_path / 'missing'))
