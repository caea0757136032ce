"""Expert parallelism: a tiny MoE trains to one device's losses on every mesh layout with experts
split over `expert` (with data, fsdp, context and tensor), the loss-free balancing bias moving
identically; bad expert counts fail with one line."""

import numpy as np
import pytest

from dlmjax import config as config_lib
from tests.conftest import tiny_test_config
from tests.train.step_test import run_steps

MOE = {
  'model.num_experts': 8,
  'model.experts_per_token': 2,
  'model.moe_ffn_dim': 32,
  'model.shared_experts': 1,
  'model.router': 'sigmoid_bias',
  'train.moe_balance_loss': 0.01,
  'train.moe_z_loss': 0.001,
  'train.moe_bias_rate': 0.01,
  'model.num_kv_heads': 4,  # context x tensor = 4 splits the heads
  'diffusion.varlen_prob': 0.0,
}


def moe_config(**mesh):
  axes = {f'mesh.{a}': mesh.get(a, 1) for a in ('data', 'fsdp', 'expert', 'context', 'tensor')}
  return tiny_test_config(**MOE, **axes)


@pytest.fixture(scope='module')
def one_device():
  return run_steps(moe_config(), num_steps=3)


@pytest.mark.slow  # each layout compiles a sharded step (~10 s on 2 cores)
@pytest.mark.parametrize(
  'mesh', [dict(data=2, fsdp=2, expert=2), dict(expert=2, context=2, tensor=2)]
)
def test_expert_layouts_match_one_device(one_device, mesh):
  want_losses, want_state = one_device
  losses, state = run_steps(moe_config(**mesh), num_steps=3)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
  bias = np.asarray(state['params']['blocks']['mlp']['router_bias'])
  np.testing.assert_allclose(bias, want_state['params']['blocks']['mlp']['router_bias'], atol=1e-6)
  assert np.any(bias != 0)  # the balancing update ran
  # The experts really are split: each device holds E / expert of them.
  gate = state['params']['blocks']['mlp']['gate_proj']
  assert gate.addressable_shards[0].data.shape[1] == 8 // mesh['expert']


@pytest.mark.parametrize(
  'overrides,message',
  [
    (
      {'mesh.expert': 3, 'mesh.fsdp': 1, 'model.num_experts': 8},
      'num_experts=8 is not divisible by mesh.expert=3',
    ),
    ({'model.num_experts': 4, 'model.experts_per_token': 5}, 'experts_per_token=5 must be in'),
    ({'mesh.expert': 2, 'mesh.fsdp': 1}, 'mesh.expert=2 splits MoE experts but'),
  ],
)
def test_bad_expert_configs_name_the_fix(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(tiny_test_config(**overrides))


def test_a_checkpoint_with_other_experts_names_the_keys_to_set_back():
  from dlmjax.checkpoint import manager

  saved = tiny_test_config(**{'model.num_experts': 8})
  with pytest.raises(manager.CheckpointError, match='model.num_experts: checkpoint 8, run 4'):
    manager.check_architecture(saved, tiny_test_config(**{'model.num_experts': 4}))
