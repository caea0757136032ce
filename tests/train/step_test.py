"""The shared step: every mesh gives the single-device losses; accumulation is exact."""

import jax
import numpy as np
import pytest

from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config


def run_steps(config, num_steps=5):
  devices = jax.devices()[:config.mesh.data * config.mesh.fsdp * config.mesh.tensor]
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, devices))
  state = setup.init_state(config.seed)
  step_fn = step_lib.CompiledStep(setup, stages.STAGES['pretrain'].loss_fn(config))
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(num_steps):
    tokens = rng.integers(4, config.model.vocab_size,
                          size=(config.train.global_batch_size, config.model.seq_len + 1))
    batch = {'tokens': jax.device_put(tokens.astype(np.int32), step_fn.batch_sharding)}
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics['loss']))
  return np.array(losses), state


@pytest.fixture(scope='module')
def single_device_losses():
  return run_steps(tiny_test_config(**{'diffusion.varlen_prob': 0.3, 'mesh.fsdp': 1}))[0]


@pytest.mark.parametrize('data,fsdp,tensor', [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)])
def test_mesh_layouts_match_single_device(single_device_losses, data, fsdp, tensor):
  config = tiny_test_config(**{'diffusion.varlen_prob': 0.3, 'mesh.data': data,
                               'mesh.fsdp': fsdp, 'mesh.tensor': tensor})
  losses, state = run_steps(config)
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-4)
  assert losses[-1] < losses[0]
  # Parameters really are split: the embedding lives in shards of the mesh.
  embedding = state['params']['embed_tokens']
  assert len({str(s.index) for s in embedding.addressable_shards}) == fsdp * tensor


def test_gradient_accumulation_is_exact():
  one, _ = run_steps(tiny_test_config(**{'diffusion.varlen_prob': 0.0, 'mesh.fsdp': 1,
                                         'train.micro_batch_size': 16}), num_steps=3)
  two, _ = run_steps(tiny_test_config(**{'diffusion.varlen_prob': 0.0, 'mesh.fsdp': 1,
                                         'train.micro_batch_size': 8}), num_steps=3)
  np.testing.assert_allclose(one, two, rtol=1e-5)


def test_microbatch_split_is_strided():
  x = np.arange(12)
  np.testing.assert_array_equal(step_lib.microbatch_split(x, 3),
                                [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])


@pytest.mark.parametrize('objective,mask', [('ar', 'causal'), ('mdm', 'block_causal')])
def test_other_objectives_and_masks_train(objective, mask):
  losses, _ = run_steps(tiny_test_config(**{
      'diffusion.objective': objective, 'model.attention_mask': mask, 'model.block_size': 8,
      'mesh.fsdp': 1, 'train.lr': 1e-2, 'train.warmup_steps': 0}), num_steps=4)
  assert np.isfinite(losses).all()
  assert losses[-1] < losses[0]
