"""The shared step: every mesh gives the single-device losses; accumulation is exact."""

import dataclasses

import jax
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.data import pipeline
from dlmjax.diffusion import masking
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.train import faults
from tests.conftest import tiny_test_config
from tests.diffusion import loss_test


def run_steps(config, num_steps=5, learnable=False):
  """(losses, final state) of num_steps steps on random tokens, or, when learnable, on rows that
  count up."""
  return run_steps_with_metrics(config, num_steps, learnable)[:2]


def run_steps_with_metrics(config, num_steps=5, learnable=False):
  """run_steps and the last step's metrics."""
  devices = jax.devices()[: config_lib.mesh_size(config)]
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, devices))
  state = setup.init_state(config.seed)
  step_fn = step_lib.CompiledStep(setup, stages.build(config))
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(num_steps):
    shape = (config.train.global_batch_size, config.model.seq_len + 1)
    tokens = rng.integers(4, config.model.vocab_size, size=shape)
    if learnable:  # uniform random tokens are at the loss floor already: give the model a rule
      tokens = 4 + (tokens[:, :1] + np.arange(shape[1])) % 64
    arrays = {'tokens': tokens.astype(np.int32)}
    if config.data.packing:  # documents of ~8 tokens
      arrays['tokens'][rng.random(tokens.shape) < 0.125] = config.model.eos_token_id
      arrays['segment_ids'] = pipeline.document_segment_ids(
        arrays['tokens'], config.model.eos_token_id
      )
    batch = {k: jax.device_put(v, step_fn.batch_sharding) for k, v in arrays.items()}
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics['loss']))
  return np.array(losses), state, metrics


@pytest.fixture(scope='module')
def single_device_losses():
  return run_steps(tiny_test_config(**{'diffusion.varlen_prob': 0.3, 'mesh.fsdp': 1}))[0]


@pytest.mark.parametrize('data,fsdp,tensor', [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)])
def test_mesh_layouts_match_single_device(single_device_losses, data, fsdp, tensor):
  config = tiny_test_config(
    **{'diffusion.varlen_prob': 0.3, 'mesh.data': data, 'mesh.fsdp': fsdp, 'mesh.tensor': tensor}
  )
  losses, state = run_steps(config)
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-4)
  assert losses[-1] < losses[0]
  # Parameters really are split: the embedding lives in shards of the mesh.
  embedding = state['params']['embed_tokens']
  assert len({str(s.index) for s in embedding.addressable_shards}) == fsdp * tensor


@pytest.mark.slow  # ~21 s on 2 cores: two step compiles
def test_gradient_accumulation_is_exact():
  one, _ = run_steps(
    tiny_test_config(
      **{'diffusion.varlen_prob': 0.0, 'mesh.fsdp': 1, 'train.micro_batch_size': 16}
    ),
    num_steps=3,
  )
  two, _ = run_steps(
    tiny_test_config(**{'diffusion.varlen_prob': 0.0, 'mesh.fsdp': 1, 'train.micro_batch_size': 8}),
    num_steps=3,
  )
  np.testing.assert_allclose(one, two, rtol=1e-5)


def test_microbatch_split_is_strided():
  x = np.arange(12)
  np.testing.assert_array_equal(
    step_lib.microbatch_split(x, 3), [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
  )


@pytest.mark.parametrize('objective,mask', [('ar', 'causal'), ('mdm', 'block_causal')])
def test_other_objectives_and_masks_train(objective, mask):
  losses, _ = run_steps(
    tiny_test_config(
      **{
        'diffusion.objective': objective,
        'model.attention_mask': mask,
        'model.block_size': 8,
        'mesh.fsdp': 1,
        'train.lr': 1e-2,
        'train.warmup_steps': 0,
      }
    ),
    num_steps=4,
    learnable=True,
  )
  assert np.isfinite(losses).all()
  assert losses[-1] < losses[0]


def test_step_loss_is_the_masked_diffusion_formula(single_device_losses):
  """The first step's loss is MegaDLMs' formula written out here on the model's own logits:
  sum over micro-batches of sum_{b,i} CE_bi m_bi / p_b, over the sum of rows x kept length.

  It replaces losses pinned on an old commit (they guarded that data.packing left the default
  path alone): a formula breaks when a feature does, not when XLA rounds differently."""
  config = tiny_test_config(**{'diffusion.varlen_prob': 0.3, 'mesh.fsdp': 1})
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  module = model_lib.merge(setup.model_config, setup.init_state(config.seed)['params'])
  logits_fn = jax.jit(lambda tokens, length: module(tokens, valid_length_B=length))
  rows, seq_len = config.train.global_batch_size, config.model.seq_len
  num_micro = rows // config.train.micro_batch_size
  x = np.random.default_rng(0).integers(4, config.model.vocab_size, size=(rows, seq_len + 1))[
    :, :-1
  ]  # run_steps' first
  num = den = 0.0
  for micro in range(num_micro):
    ids = np.arange(rows)[micro::num_micro]  # the strided micro-batch split of step 0
    length = int(masking.varlen_length(config.seed, 0, micro, seq_len=seq_len, prob=0.3))
    noisy, masked, _ = masking.forward_process(
      masking.example_keys(config.seed, 0, ids),
      x[ids].astype(np.int32),
      mask_id=config.model.mask_token_id,
      length=length,
    )
    ce = loss_test.numpy_ce(np.asarray(logits_fn(noisy, np.full(len(ids), length))), x[ids])
    m = np.asarray(masked)
    assert not m[:, length:].any()
    num += (ce * m / (m.sum(1, keepdims=True) / length)).sum()
    den += len(ids) * length
  np.testing.assert_allclose(single_device_losses[0], num / den, rtol=1e-5)


def test_packed_step_accumulates_segment_ids_exactly():
  """segment_ids travel with their rows through the micro-batch split: the 2-micro-batch step's
  loss equals the packed loss of the whole batch at once."""
  config = tiny_test_config(**{'data.packing': True, 'diffusion.varlen_prob': 0.0, 'mesh.fsdp': 1})
  losses, _ = run_steps(config, num_steps=1)
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  params = setup.init_state(config.seed)['params']
  rng = np.random.default_rng(0)  # the first batch of run_steps
  tokens = rng.integers(
    4, config.model.vocab_size, size=(config.train.global_batch_size, config.model.seq_len + 1)
  )
  tokens[rng.random(tokens.shape) < 0.125] = config.model.eos_token_id
  segment_ids = pipeline.document_segment_ids(tokens, config.model.eos_token_id)
  assert segment_ids.max() > 3
  stage = stages.build(config)
  _, sums = jax.jit(
    lambda p: stage.loss(
      model_lib.merge(setup.model_config, p),
      tokens,
      segment_ids=segment_ids,
      step=0,
      micro_index=0,
      example_ids_B=np.arange(16),
      seed=config.seed,
      mask_id=config.model.mask_token_id,
      varlen_prob=0.0,
    )
  )(params)
  np.testing.assert_allclose(losses[0], float(stage.metrics(sums)['loss']), rtol=1e-5)


def test_non_finite_step_skips_the_update():
  config = tiny_test_config(**{'mesh.fsdp': 1})
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  state = setup.init_state(config.seed)
  stage = stages.build(config)
  step_fn = step_lib.CompiledStep(
    setup, dataclasses.replace(stage, loss=faults.nan_on([1], stage.loss))
  )
  rng = np.random.default_rng(0)
  snapshots, skipped = [], []
  for _ in range(3):
    tokens = rng.integers(4, 100, size=(16, 33)).astype(np.int32)
    state, metrics = step_fn(state, {'tokens': jax.device_put(tokens, step_fn.batch_sharding)})
    snapshots.append(jax.device_get((state['params'], state['opt_state'])))
    skipped.append(float(metrics['skipped']))
  assert skipped == [0.0, 1.0, 0.0]
  assert int(state['step']) == 3
  for a, b in zip(jax.tree.leaves(snapshots[0]), jax.tree.leaves(snapshots[1])):
    np.testing.assert_array_equal(a, b)  # params and optimizer (and its count) untouched
  changed = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(snapshots[1][0]), jax.tree.leaves(snapshots[2][0]))
  ]
  assert all(changed) and all(np.isfinite(x).all() for x in jax.tree.leaves(snapshots[2][0]))
