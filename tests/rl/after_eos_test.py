"""What an objective scores after a completion's first EOS is its own declaration (following its
paper): coupled-GRPO keeps the tokens as generated (DiffuCoder's coupled_grpo.py rewrites nothing:
its partial views see them as unmasked context), the others keep LLaDA's EOS padding. A rollout
built from one fixed sampler output shows the rows each objective trains and scores on."""

import types

import jax
import numpy as np
import pytest

from dlmjax import tasks
from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import objectives, rollout
from dlmjax.train import state as state_lib
from tests.conftest import tiny_test_config

ROWS, PROMPT, GEN, EOS = 4, 4, 8, 2
JUNK = [9, 10, 11, 12]  # what the sampler left after the first EOS


class _FixedSampler:
  """The rollout sampler's interface over one fixed output: completion [7, 8, EOS, junk..]."""

  def __init__(self, pad_id):
    self.pad_id = pad_id

  def pad(self, token_ids):
    return prompt_rows.pad_prompts(token_ids, self.pad_id, width=PROMPT)

  def generate(self, params, prompt_BP, prompt_lengths_B, key):
    del params, prompt_lengths_B, key
    canvas = np.array([[7, 8, EOS, *JUNK, EOS]] * ROWS, np.int32)
    return np.concatenate([prompt_BP, canvas], axis=1)

  def texts(self, out_BW):
    return ['<answer>1+1</answer>'] * len(out_BW)


def _config(objective):
  return tiny_test_config(
    **{
      'stage': 'rl',
      'rl.objective': objective,
      'rl.kl_beta': 0.0,
      'model.seq_len': PROMPT + GEN,
      'train.global_batch_size': ROWS,
      'train.micro_batch_size': ROWS,
      'rl.group_size': 2,
      'rl.max_prompt_tokens': PROMPT,
      'sampler.gen_length': GEN,
      'sampler.block_length': GEN,
      'rl.inner_updates': 1,
      'init_from': 'unused: the params are made here',
    }
  )


@pytest.fixture(scope='module')
def model():
  c = _config('d1')
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
  return setup, setup.init_state(0)['params']


def _first_batch(objective, model):
  setup, params = model
  c = _config(objective)
  task = tasks.get_task('countdown3')
  example = task.examples('train', 1, seed=0)[0]
  prompts = types.SimpleNamespace(
    training=types.SimpleNamespace(examples=[example], token_ids=[[5, 6, 7]]), task=task
  )
  batches = rollout.RolloutBatches(c, setup, prompts, _FixedSampler(c.model.pad_token_id))
  return c, batches.next(params)[0]


def test_each_objective_trains_and_scores_the_rows_its_paper_does(model):
  coupled_config, coupled = _first_batch('coupled_grpo', model)
  _, d1 = _first_batch('d1', model)
  completion = slice(3, 3 + GEN)  # prompt [5, 6, 7], then the canvas
  np.testing.assert_array_equal(coupled['tokens'][0, completion], [7, 8, EOS, *JUNK, EOS])
  np.testing.assert_array_equal(d1['tokens'][0, completion], [7, 8, EOS] + [EOS] * 5)
  for batch in (coupled, d1):  # either way the loss counts the tokens up to the first EOS
    np.testing.assert_array_equal(batch['completion_mask'][0, completion], [1, 1, 1] + [0] * 5)
  # The old estimate is scored on the same rows the loss trains on (one estimator for both).
  setup, params = model
  score = rollout.make_score_fn(coupled_config, setup.model_config)
  args = (coupled['prompt_lengths'], coupled['lengths'], coupled['mask_seeds'])
  np.testing.assert_array_equal(coupled['old'], np.asarray(score(params, coupled['tokens'], *args)))
  # For coupled-GRPO the choice is seen: the junk is context of the partial views.
  rewritten = np.asarray(score(params, d1['tokens'], *args))
  scored = coupled['completion_mask'] > 0
  assert np.abs(coupled['old'] - rewritten)[scored].max() > 1e-4


def test_d1_and_wd1_cannot_see_the_tokens_after_eos(model):
  """Their estimate masks the whole completion canvas: EOS padding or the generated tokens give
  the same scored log-probs, so the EOS-padded rows they keep match d1's and wd1's code."""
  setup, params = model
  _, batch = _first_batch('d1', model)
  generated = batch['tokens'].copy()
  generated[:, 6 : 6 + len(JUNK)] = JUNK
  args = (batch['prompt_lengths'], batch['lengths'], batch['mask_seeds'])
  for name in ('d1', 'wd1'):
    c = _config(name)
    objective = objectives.get(name)
    module = model_lib.merge(setup.model_config, params)
    estimate = jax.jit(
      lambda tokens, o=objective, s=objective.settings(c): o.estimate(
        module,
        dict(tokens=tokens, prompt_lengths=args[0], lengths=args[1], mask_seeds=args[2]),
        seed=c.seed,
        settings=s,
      )
    )
    scored = batch['completion_mask'] > 0
    np.testing.assert_array_equal(
      np.asarray(estimate(batch['tokens']))[scored], np.asarray(estimate(generated))[scored]
    )
