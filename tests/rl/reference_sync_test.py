"""rl.ref_sync_every: the KL reference, refreshed from the policy every N steps (d1's
sync_ref_model), lives in the train state and resumes exactly across a refresh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.checkpoint import manager
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import objectives
from tests.rl import compiled

PROMPT, GEN, ROWS = compiled.PROMPT, compiled.GEN, compiled.ROWS
EVERY, ALPHA = compiled.SYNC_EVERY, compiled.SYNC_ALPHA


@pytest.fixture(scope='module')
def run():
  """The tiny d1 step with the reference in its state (shared with the direction test) and a
  fixed batch whose reference differs from the old policy, so the KL has a gradient."""
  c, setup, step_fn, score = compiled.rl_step('d1')
  rng = np.random.default_rng(0)
  width = c.model.seq_len
  tokens = rng.integers(4, c.model.vocab_size, size=(ROWS, width)).astype(np.int32)
  tokens[:, PROMPT + GEN :] = c.model.pad_token_id
  prompt_lengths = np.full(ROWS, PROMPT, np.int32)
  lengths = np.full(ROWS, PROMPT + GEN, np.int32)
  completion = np.zeros((ROWS, width), np.float32)
  completion[:, PROMPT : PROMPT + GEN] = 1.0
  seeds = np.arange(ROWS, dtype=np.int32)
  initial = setup.init_state(0)  # copied for each run: the step donates its state
  old = np.asarray(score(initial['params'], tokens, prompt_lengths, lengths, seeds))
  advantages = np.tile(np.array([0.5, -0.5], np.float32), ROWS // 2)
  batch = dict(
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    lengths=lengths,
    mask_seeds=seeds,
    advantages=advantages,
    old=old,
    ref=old - 0.1,
    completion_mask=completion,
    weight=objectives.get('d1').loss_weights(completion),
    rewards=advantages,
  )
  batch = {k: jax.device_put(v, step_fn.batch_sharding) for k, v in batch.items()}
  return c, setup, step_fn, batch, initial


def _host(state):
  return jax.tree.map(np.asarray, jax.device_get(state))


def test_reference_refreshes_every_n_steps_and_resumes_exactly(run, tmp_path):
  _, setup, step_fn, batch, initial = run
  state = jax.tree.map(jnp.copy, initial)
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
  state, _ = step_fn(jax.tree.map(jnp.copy, initial), batch)
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
  c, setup = run[:2]
  reference = reference_lib.ReferenceModel(c, setup)
  with pytest.raises(RuntimeError, match='use'):
    reference.params()
  marker = {'w': np.ones(2)}
  reference.use(marker)
  assert reference.params() is marker
