"""rl.ref_sync_every: the KL reference, refreshed from the policy every N steps (d1's
sync_ref_model), lives in the train state and resumes exactly across a refresh."""

import jax
import numpy as np
import pytest

from dlmjax.checkpoint import manager
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import rollout
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config

PROMPT, GEN, ROWS, EVERY, ALPHA = 6, 16, 8, 2, 0.6


@pytest.fixture(scope='module')
def run():
  """One tiny d1 setup with the reference in its state, its compiled step and a fixed batch."""
  c = tiny_test_config(
    **{
      'stage': 'rl',
      'model.seq_len': 24,
      'train.global_batch_size': ROWS,
      'train.micro_batch_size': 4,
      'train.schedule': 'constant',
      'train.warmup_steps': 0,
      'train.lr': 1e-3,
      'rl.group_size': 2,
      'rl.max_prompt_tokens': PROMPT,
      'sampler.gen_length': GEN,
      'sampler.block_length': GEN,
      'sampler.steps': 4,
      'rl.kl_beta': 0.04,
      'rl.ref_sync_every': EVERY,
      'rl.ref_sync_alpha': ALPHA,
      'init_from': 'unused: the params are made here',
    }
  )
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, c.model.vocab_size, size=(ROWS, 24)).astype(np.int32)
  tokens[:, PROMPT + GEN :] = c.model.pad_token_id
  prompt_lengths = np.full(ROWS, PROMPT, np.int32)
  lengths = np.full(ROWS, PROMPT + GEN, np.int32)
  completion = np.zeros((ROWS, 24), np.float32)
  completion[:, PROMPT : PROMPT + GEN] = 1.0
  seeds = np.arange(ROWS, dtype=np.int32)
  params0 = setup.init_state(0)['params']
  old = np.asarray(
    rollout.make_score_fn(c, setup.model_config)(params0, tokens, prompt_lengths, lengths, seeds)
  )
  advantages = np.tile(np.array([0.5, -0.5], np.float32), ROWS // 2)
  batch = dict(
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    lengths=lengths,
    mask_seeds=seeds,
    advantages=advantages,
    old=old,
    ref=old - 0.1,  # a KL gradient too
    completion_mask=completion,
    weight=rollout.loss_weights(completion, 'd1'),
    rewards=advantages,
  )
  step_fn = step_lib.CompiledStep(setup, stages.build(c))
  batch = {k: jax.device_put(v, step_fn.batch_sharding) for k, v in batch.items()}
  return c, setup, step_fn, batch


def _host(state):
  return jax.tree.map(np.asarray, jax.device_get(state))


def test_reference_refreshes_every_n_steps_and_resumes_exactly(run, tmp_path):
  c, setup, step_fn, batch = run
  state = setup.init_state(0)
  assert 'reference' in state
  history = [_host(state)]
  for _ in range(3):
    state, _ = step_fn(state, batch)
    history.append(_host(state))
  leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731
  # Step 1: unchanged; step 2 (a multiple of 2): alpha * policy + (1 - alpha) * reference.
  for r0, r1 in zip(leaves(history[0]['reference']), leaves(history[1]['reference'])):
    np.testing.assert_array_equal(r0, r1)
  for r1, p2, r2 in zip(
    leaves(history[1]['reference']), leaves(history[2]['params']), leaves(history[2]['reference'])
  ):
    np.testing.assert_allclose(r2, ALPHA * p2 + (1 - ALPHA) * r1, rtol=1e-6, atol=1e-7)
  assert not np.allclose(leaves(history[2]['reference'])[0], leaves(history[1]['reference'])[0])
  for r2, r3 in zip(leaves(history[2]['reference']), leaves(history[3]['reference'])):
    np.testing.assert_array_equal(r2, r3)

  # Interrupted after step 1, resumed from its checkpoint across the refresh at step 2.
  state = setup.init_state(0)
  state, _ = step_fn(state, batch)
  checkpoints = manager.RunCheckpoints(str(tmp_path), async_save=False)
  checkpoints.save(state, dict(served=1))
  checkpoints.wait()
  restored, data_state = checkpoints.restore_latest(setup)
  checkpoints.close()
  assert data_state == dict(served=1)
  for _ in range(2):
    restored, _ = step_fn(restored, batch)
  resumed = _host(restored)
  for key in ('params', 'opt_state', 'reference'):
    for a, b in zip(leaves(history[3][key]), leaves(resumed[key])):
      np.testing.assert_array_equal(a, b)


def test_rollouts_score_with_the_state_reference(run):
  c, setup, _, _ = run
  reference = reference_lib.ReferenceModel(c, setup)
  with pytest.raises(RuntimeError, match='use'):
    reference.params()
  marker = {'w': np.ones(2)}
  reference.use(marker)
  assert reference.params() is marker
