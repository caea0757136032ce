"""MoE with pipeline stages: a tiny all-MoE model trains on pipeline x expert (x data, x tensor)
meshes, GPipe and circular, to one device's losses, router metrics and loss-free balancing bias
(the router sums of every layer and pipeline micro-batch are added up before the losses are
formed, and the schedule's bubble iterations add nothing; docs/moe.md, pipeline stages)."""

import numpy as np
import pytest

from dlmjax import config as config_lib
from tests.conftest import tiny_test_config
from tests.parallel.expert_test import MOE
from tests.train import step_test

PIPE_MOE = {
  **MOE,
  'model.num_layers': 4,  # 2 stages x 2 repeats x 1 layer
  'train.global_batch_size': 8,  # 2 pipeline micro-batches x data x expert = 8 rows' owners
  'train.micro_batch_size': 8,
}
NUM_STEPS = 3  # odd: the bias moves by +-rate a step, so an even count can return it to zero


def pipe_config(exchange='gather', **mesh):
  axes = {f'mesh.{a}': 1 for a in ('data', 'fsdp', 'expert', 'context', 'tensor', 'pipeline')}
  axes.update({f'mesh.{a}': v for a, v in mesh.items()})
  return tiny_test_config(**PIPE_MOE, **axes, **{'model.moe.exchange': exchange})


def run_steps(config):
  """Losses, the last step's router metrics and the state of NUM_STEPS jitted train steps."""
  losses, state, metrics = step_test.run_steps_with_metrics(config, NUM_STEPS)
  return losses, {k: float(v) for k, v in metrics.items() if k.startswith('moe_')}, state


@pytest.fixture(scope='module')
def one_device():
  return run_steps(pipe_config())


# Circular (2 stages x 2 repeats, layer l on stage l % 2) with the experts' width over tensor and
# the gather exchange; GPipe (2 stages of 2 layers) with rows over data and expert and the
# all-to-all exchange inside the stages (the exchanges agree layer by layer: expert_exchange_test).
@pytest.mark.slow  # 16-22 s each on 2 cores (the one-device reference: 16 s more, once)
@pytest.mark.parametrize(
  'exchange,mesh',
  [
    ('gather', dict(pipeline=2, pipeline_repeats=2, expert=2, tensor=2)),
    ('all_to_all', dict(pipeline=2, expert=2, data=2)),
  ],
)
def test_pipeline_stages_match_one_device(one_device, exchange, mesh):
  want_losses, want_router, want_state = one_device
  config = pipe_config(exchange, **mesh)
  assert config_lib.pipeline_microbatches(config) == 2
  losses, router, state = run_steps(config)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert router.keys() == want_router.keys() and 'moe_balance_loss' in router
  for key, value in want_router.items():  # z-loss squares the logsumexp: float32 drift doubles
    np.testing.assert_allclose(router[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
  bias = np.asarray(state['params']['blocks']['mlp']['router_bias'])
  np.testing.assert_allclose(bias, want_state['params']['blocks']['mlp']['router_bias'], atol=1e-6)
  assert np.any(bias != 0)  # the balancing update ran
  # The stack really is split: each pipeline device holds half the layers.
  gate = state['params']['blocks']['mlp']['gate_proj']
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}


def test_mixed_dense_and_moe_layers_with_pipeline_stages_name_the_fix():
  config = pipe_config(pipeline=2, data=4)
  config.model.moe.dense_layers = '0'
  with pytest.raises(config_lib.ConfigError, match='mixes dense and MoE layers; set --config.mesh'):
    config_lib.validate(config, num_devices=8)
