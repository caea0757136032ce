"""The Stage contract: each stage declares its arrays and follows the step's micro-batch rule."""

import jax
import numpy as np
import pytest

from dlmjax.tasks import code_exec
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config

# Every stage on the tiny model, with what it needs to validate (RL, SFT, preference and reward
# start from a model; the path is never read here: neither the batches nor the evaluator are
# opened).
_STAGE_CONFIGS = {
  'pretrain': {'diffusion.varlen_prob': 0.0},
  'sft': {'init_from': 'unused'},
  'rl': {
    'init_from': 'unused',
    'model.seq_len': 64,
    'rl.max_prompt_tokens': 16,
    'sampler.gen_length': 16,
    'sampler.steps': 2,
    'sampler.block_length': 16,
  },
  'preference': {'init_from': 'unused', 'preference.budget': 2},
  'reward': {'init_from': 'unused'},
}


def _one_step(name, micro_batch_size):
  c = tiny_test_config(
    **{
      'stage': name,
      'mesh.fsdp': 1,
      'train.micro_batch_size': micro_batch_size,
      **_STAGE_CONFIGS[name],
    }
  )
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
  stage = stages.build(c)
  batch = stage.example_batch(np.random.default_rng(0))
  step_fn = step_lib.CompiledStep(setup, stage)
  state, metrics = step_fn(
    setup.init_state(c.seed),
    {k: jax.device_put(v, step_fn.batch_sharding) for k, v in batch.items()},
  )
  return stage, batch, jax.device_get(state['params']), jax.device_get(metrics)


@pytest.mark.parametrize('name', sorted(stages.BUILDERS))
def test_a_stage_declares_its_batch_and_the_step_sums_its_micro_batches(name):
  """example_batch holds exactly batch_keys at the global batch size, the step runs on it, and
  one step over 2 micro-batches moves the params as one over the whole batch: the rule every
  loss is written to (a loss missing its 1/micro-batches share, or RL's old compensating
  factor, would double or halve the update)."""
  stage, batch, params_whole, metrics_whole = _one_step(name, 16)
  assert stage.name == name
  assert set(batch) == set(stage.batch_keys)
  assert all(v.shape[0] == 16 for v in batch.values())
  # The console's other names come into the row from outside the step: the reporter's step time
  # and the rollout's generate / score seconds and code verdict shares (rl/rollout.py), the
  # preference batch source's reference-scoring seconds (train/stages/preference.py).
  from_outside = {'step_time_s', 'generate_s', 'score_s', 'reference_s'}
  from_outside |= {f'code_{verdict}' for verdict in code_exec.VERDICTS}
  assert {'loss', 'tokens', *stage.console_metrics} - from_outside <= set(metrics_whole)
  assert np.isfinite(metrics_whole['loss']) and metrics_whole['skipped'] == 0.0
  _, _, params_split, metrics_split = _one_step(name, 8)
  np.testing.assert_allclose(metrics_split['grad_norm'], metrics_whole['grad_norm'], rtol=1e-5)
  np.testing.assert_allclose(metrics_split['loss'], metrics_whole['loss'], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params_split), jax.tree.leaves(params_whole)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
