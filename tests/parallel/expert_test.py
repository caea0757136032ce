"""Expert parallelism: a tiny MoE trains to one device's losses with experts split over `expert`
and their width over `tensor`, rows over `data` and `expert` (the all-gather, the reduce-scatter
and the sum over `tensor`; or the two all-to-alls of model.moe.exchange=all_to_all), the
loss-free balancing bias moving identically; bad expert counts fail with one line."""

import numpy as np
import pytest

from dlmjax import config as config_lib
from tests.conftest import tiny_test_config
from tests.model.moe_test import TINY_MOE
from tests.train.step_test import run_steps

MOE = {
  **TINY_MOE,
  'model.num_layers': 1,
  'model.seq_len': 16,
  'model.num_heads': 4,  # context x tensor = 4 splits the heads
  'model.num_kv_heads': 4,
  'model.moe.shared_experts': 1,
  'model.moe.router': 'sigmoid_bias',
  'model.moe.balance_loss': 0.01,
  'model.moe.z_loss': 0.001,
  'model.moe.bias_rate': 0.01,
  'train.warmup_steps': 0,  # the first step already moves the experts (a zero lr hides them)
  'train.lr': 0.03,  # far enough that a wrong expert output shows in the next step's loss
  'train.schedule': 'constant',
  'train.global_batch_size': 4,  # one micro-batch: data x expert = 4 rows' owners
  'train.micro_batch_size': 4,
  'diffusion.varlen_prob': 0.0,
}


def moe_config(exchange='gather', **mesh):
  axes = {f'mesh.{a}': mesh.get(a, 1) for a in ('data', 'fsdp', 'expert', 'context', 'tensor')}
  return tiny_test_config(**MOE, **axes, **{'model.moe.exchange': exchange})


@pytest.fixture(scope='module')
def one_device():
  # Odd: the bias moves by +-rate a step, so an even count can return it to zero.
  return run_steps(moe_config(), num_steps=3)


# The first layout exercises every collective of the dispatch: rows split over data and expert,
# experts over expert, their width over tensor; the second splits the rows' length over context.
# all_to_all: the same layouts with the assignments exchanged, and one expert a device.
@pytest.mark.parametrize(
  'exchange,mesh',
  [
    ('gather', dict(data=2, expert=2, tensor=2)),
    ('gather', dict(expert=2, context=2, tensor=2)),
    ('all_to_all', dict(data=2, expert=2, tensor=2)),
    ('all_to_all', dict(expert=4, tensor=2)),
  ],
)
def test_expert_layouts_match_one_device(one_device, exchange, mesh):
  want_losses, want_state = one_device
  losses, state = run_steps(moe_config(exchange, **mesh), num_steps=3)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
  bias = np.asarray(state['params']['blocks']['mlp']['router_bias'])
  np.testing.assert_allclose(bias, want_state['params']['blocks']['mlp']['router_bias'], atol=1e-6)
  assert np.any(bias != 0)  # the balancing update ran
  # The experts really are split: each device holds E / expert of them.
  gate = state['params']['blocks']['mlp']['gate_proj']
  assert gate.addressable_shards[0].data.shape[1] == 4 // mesh['expert']


@pytest.mark.parametrize(
  'overrides,message',
  [
    (
      {'mesh.expert': 3, 'mesh.fsdp': 1, 'model.moe.num_experts': 8},
      'num_experts=8 is not divisible by mesh.expert=3',
    ),
    (
      {'model.moe.num_experts': 4, 'model.moe.experts_per_token': 5},
      'experts_per_token=5 must be in',
    ),
    ({'mesh.expert': 2, 'mesh.fsdp': 1}, 'mesh.expert=2 splits MoE experts but'),
  ],
)
def test_bad_expert_configs_name_the_fix(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(tiny_test_config(**overrides))


def test_a_checkpoint_with_other_experts_names_the_keys_to_set_back():
  from dlmjax.checkpoint import compatibility
  from dlmjax.checkpoint import run_dir as run_dir_lib

  saved = tiny_test_config(**{'model.moe.num_experts': 8})
  with pytest.raises(
    run_dir_lib.CheckpointError, match='model.moe.num_experts: checkpoint 8, run 4'
  ):
    compatibility.check_architecture(saved, tiny_test_config(**{'model.moe.num_experts': 4}))
