"""Pipeline parallelism: every schedule gives the plain layer scan's outputs, losses, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.data import pipeline as data_pipeline
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.parallel import pipeline
from dlmjax.parallel import rules
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config
from tests.train import step_test


def _toy_layer(x, w, side):
  return jnp.tanh(x @ w['w']) + 0.1 * side['positions_BL'][..., None] * w['b'][None, None]


def _toy_layers(params, x_BLD, side):
  """A stand-in stack whose layers differ and read a per-row side input."""
  return jax.lax.scan(lambda x, w: (_toy_layer(x, w, side), None), x_BLD, params)[0]


def _toy_inputs(rng, num_layers, dim, rows):
  """(params, their axes, x [rows, 3, dim], side) of a _toy_layers stack."""
  params = dict(
    w=rng.normal(size=(num_layers, dim, dim)).astype(np.float32) / dim**0.5,
    b=rng.normal(size=(num_layers, dim)).astype(np.float32),
  )
  axes = dict(w=(rules.LAYERS, None, None), b=(rules.LAYERS, None))
  x = rng.normal(size=(rows, 3, dim)).astype(np.float32)
  side = dict(positions_BL=rng.integers(0, 9, size=(rows, 3)).astype(np.float32))
  return params, axes, x, side


def _pipeline_mesh(stages_):
  shape = [stages_ if axis == 'pipeline' else 1 for axis in config_lib.MESH_AXES]
  return jax.sharding.Mesh(np.asarray(jax.devices()[:stages_]).reshape(shape), config_lib.MESH_AXES)


# GPipe with more and fewer micro-batches than stages; circular with M > S (outputs wait in the
# buffer before their next repeat) and M = S (they return at once).
@pytest.mark.parametrize('stages_,repeats,micro', [(2, 1, 4), (4, 1, 2), (2, 3, 4), (4, 2, 4)])
def test_schedule_equals_the_plain_stack(stages_, repeats, micro):
  num_layers, dim = stages_ * repeats * 2, 8
  rng = np.random.default_rng(stages_ * 100 + repeats * 10 + micro)
  params, axes, x, side = _toy_inputs(rng, num_layers, dim, 4 * micro)

  def loss(fn, p, x):
    return jnp.sum(jnp.sin(fn(p, x, side)))

  def piped(p, x, side):
    return pipeline.run(
      _toy_layers, p, axes, x, side, stages=stages_, repeats=repeats, microbatches=micro
    )

  want = jax.jit(jax.value_and_grad(lambda p, x: loss(_toy_layers, p, x), argnums=(0, 1)))
  with rules.activation_mesh(_pipeline_mesh(stages_)):
    got = jax.jit(jax.value_and_grad(lambda p, x: loss(piped, p, x), argnums=(0, 1)))(params, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want(params, x))):
    # float32 through up to 16 layers of O(1) values: last-bit rounding, not schedule errors
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# GPipe and circular; M < S, so stages idle the most of the schedule (their rows are stale).
@pytest.mark.parametrize('stages_,repeats,micro', [(4, 1, 2), (2, 2, 2), (2, 3, 4)])
def test_aux_holds_every_layer_and_micro_batch_and_nothing_of_the_bubbles(stages_, repeats, micro):
  """With aux, every layer's per-micro-batch values (as an MoE's router sums) come back at
  [micro-batch, layer]: those of the plain stack run on that micro-batch alone."""
  num_layers, dim = stages_ * repeats, 4
  params, axes, x, side = _toy_inputs(np.random.default_rng(7), num_layers, dim, 2 * micro)

  def with_aux(p, x, side):  # per layer: the sum of its input and a count of its rows
    def layer(x, w):
      return _toy_layer(x, w, side), dict(sum=jnp.sum(x), rows=jnp.asarray(x.shape[0], jnp.float32))

    return jax.lax.scan(layer, x, p)

  with rules.activation_mesh(_pipeline_mesh(stages_)):
    got_x, got = jax.jit(
      lambda p, x, side: pipeline.run(
        with_aux, p, axes, x, side, stages=stages_, repeats=repeats, microbatches=micro, aux=True
      )
    )(params, x, side)
  want_x, _ = with_aux(params, x, side)
  np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
  assert got['sum'].shape == (micro, num_layers)
  np.testing.assert_array_equal(got['rows'], np.full((micro, num_layers), 2.0))
  for m in range(micro):  # micro-batch m: rows m, m + M, ... (strided, as pipeline._split)
    _, want = with_aux(params, x[m::micro], {k: v[m::micro] for k, v in side.items()})
    np.testing.assert_allclose(got['sum'][m], want['sum'], rtol=1e-5, atol=1e-5)


def test_bubble_fraction_counts_idle_stage_iterations():
  for stages_, repeats, micro in [(2, 1, 1), (4, 1, 8), (4, 2, 4), (8, 3, 8)]:
    iterations = repeats * micro + stages_ - 1
    busy = sum(0 <= t - s < repeats * micro for t in range(iterations) for s in range(stages_))
    assert pipeline.bubble_fraction(stages_, repeats, micro) == pytest.approx(
      1 - busy / (iterations * stages_)
    )


@pytest.mark.parametrize(
  'layers,batch,repeats,micro,message',
  [
    (6, 8, 1, 2, 'layers do not split'),
    (8, 6, 1, 4, 'micro-batches'),
    (8, 8, 2, 1, 'at least one micro-batch per stage'),
  ],
)
def test_bad_schedules_are_refused(layers, batch, repeats, micro, message):
  with pytest.raises(ValueError, match=message):
    pipeline.check_schedule(layers, batch, stages=4, repeats=repeats, microbatches=micro)


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'mesh.pipeline': 4, 'model.num_layers': 6}, 'num_layers=6 is not divisible'),
    ({'mesh.pipeline': 2, 'mesh.pipeline_repeats': 2}, 'num_layers=2 is not divisible'),
    (
      {
        'mesh.pipeline': 2,
        'mesh.pipeline_repeats': 2,
        'model.num_layers': 4,
        'mesh.pipeline_microbatches': 1,
      },
      'pipeline_microbatches >= mesh.pipeline',
    ),
    (
      {'mesh.pipeline': 2, 'mesh.fsdp': 4, 'mesh.pipeline_microbatches': 4},
      'micro_batch_size=8 does not split into 4',
    ),
    ({'mesh.pipeline_repeats': 0}, 'pipeline_repeats=0 must be >= 1'),
  ],
)
def test_config_validation_names_the_fix(overrides, message):
  config = tiny_test_config(**{'mesh.fsdp': -1, **overrides})
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, num_devices=8)


def objective_and_grads(config):
  """Loss and gradients of the pretraining objective on the config's mesh and schedule (with
  documents when data.packing, truncated rows when diffusion.varlen_prob = 1)."""
  devices = jax.devices()[: config_lib.mesh_size(config)]
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, devices))
  params = setup.init_state(config.seed)['params']
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, config.model.vocab_size, size=(8, config.model.seq_len + 1))
  fields = {}
  if config.data.packing:  # documents of ~6 tokens
    tokens[rng.random(tokens.shape) < 0.16] = config.model.eos_token_id
    fields['segment_ids'] = data_pipeline.document_segment_ids(tokens, config.model.eos_token_id)
  loss_fn = stages.build(config).loss

  def objective(p):
    return loss_fn(
      model_lib.merge(setup.model_config, p),
      tokens.astype(np.int32),
      step=3,
      micro_index=1,
      example_ids_B=np.arange(8),
      seed=config.seed,
      mask_id=config.model.mask_token_id,
      varlen_prob=config.diffusion.varlen_prob,
      **fields,
    )[0]

  with rules.activation_mesh(setup.mesh):
    loss, grads = jax.jit(jax.value_and_grad(objective))(params)
  return float(loss), jax.device_get(grads)


def assert_same(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~30 s on 2 cores
def test_model_objective_matches_one_device():
  """The whole objective (packed documents, truncated rows, fused loss) and its gradients on
  8 layers as 4 stages x 2 circular repeats (layer l on stage l % 4) over 4 micro-batches, and
  on 2 GPipe stages whose sequence is split 4 ways (context parallelism inside the stages).
  One test, so both layouts share the single-device reference compile."""
  config = tiny_test_config(
    **{
      'model.num_layers': 8,
      'model.num_kv_heads': 4,
      'data.packing': True,
      'diffusion.varlen_prob': 1.0,
      'mesh.fsdp': 1,
    }
  )
  want = objective_and_grads(config)
  for layout in (
    dict(pipeline=4, pipeline_repeats=2, pipeline_microbatches=4),
    dict(pipeline=2, context=4),
  ):
    assert_same(
      objective_and_grads(
        tiny_test_config(
          **{
            'model.num_layers': 8,
            'model.num_kv_heads': 4,
            'data.packing': True,
            'diffusion.varlen_prob': 1.0,
            'mesh.fsdp': 1,
            **{f'mesh.{k}': v for k, v in layout.items()},
          }
        )
      ),
      want,
    )


@pytest.mark.slow  # ~25 s on 2 cores: two step compiles
def test_train_step_with_pipeline_fsdp_tensor_gives_the_single_device_losses():
  """The shared step on pipeline 2 x fsdp 2 x tensor 2 gives the losses of one device (run here,
  as tests/train/step_test.py runs it: not pinned numbers, which move with XLA)."""
  config = tiny_test_config(
    **{'diffusion.varlen_prob': 0.3, 'mesh.pipeline': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2}
  )
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  assert setup.model_config.pipeline_stages == 2
  state = setup.init_state(config.seed)
  step_fn = step_lib.CompiledStep(setup, stages.build(config))
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(2):
    tokens = rng.integers(4, config.model.vocab_size, size=(16, config.model.seq_len + 1))
    state, metrics = step_fn(
      state, {'tokens': jax.device_put(tokens.astype(np.int32), step_fn.batch_sharding)}
    )
    losses.append(float(metrics['loss']))
  single, _ = step_test.run_steps(
    tiny_test_config(**{'diffusion.varlen_prob': 0.3, 'mesh.fsdp': 1}), num_steps=2
  )
  np.testing.assert_allclose(losses, single, rtol=1e-5)
  # The layer stack really is split: each pipeline device holds one layer.
  q_proj = state['params']['blocks']['attn']['q_proj']
  assert {s.data.shape[0] for s in q_proj.addressable_shards} == {1}


def test_summary_reports_the_bubble_fraction():
  from dlmjax import summary  # pylint: disable=import-outside-toplevel

  config = tiny_test_config(
    **{
      'model.num_layers': 8,
      'mesh.pipeline': 4,
      'mesh.pipeline_repeats': 2,
      'mesh.pipeline_microbatches': 4,
    }
  )
  # (S - 1) / (R M + S - 1) = 3 / 11 with fsdp filling the other 2 devices.
  assert 'bubble fraction 0.273' in summary.summarize(config, 8)
  assert 'pipeline: off' in summary.summarize(tiny_test_config(), 8)


@pytest.mark.slow  # ~30 s on 2 cores
def test_shifted_model_objective_matches_one_device_with_pipeline_and_context():
  """model.shift_logits (Dream) shifts the hidden states after the pipeline, across the context
  shards and at packed documents' starts: 2 GPipe stages x 4-way sequence split give the single
  device's loss and gradients."""
  overrides = {
    'model.num_layers': 2,
    'model.num_kv_heads': 4,
    'model.qk_norm': False,
    'model.qkv_bias': True,
    'model.shift_logits': True,
    'data.packing': True,
    'diffusion.varlen_prob': 1.0,
    'mesh.fsdp': 1,
  }
  want = objective_and_grads(tiny_test_config(**overrides))
  got = objective_and_grads(
    tiny_test_config(**overrides, **{'mesh.pipeline': 2, 'mesh.context': 4})
  )
  assert_same(got, want)


@pytest.mark.slow  # ~20 s on 2 cores: two small compiles
def test_block_objective_matches_one_device_with_pipeline():
  """diffusion.objective=block (the two-stream forward over [x_t || x_0], packed documents whose
  blocks restart at each one's start, truncated rows) on 2 GPipe stages gives the single
  device's loss and gradients."""
  overrides = {
    'diffusion.objective': 'block',
    'model.attention_mask': 'block_causal',
    'model.block_size': 4,
    'model.num_layers': 2,
    'data.packing': True,
    'diffusion.varlen_prob': 1.0,
    'mesh.fsdp': 1,
  }
  want = objective_and_grads(tiny_test_config(**overrides))
  got = objective_and_grads(tiny_test_config(**overrides, **{'mesh.pipeline': 2}))
  assert_same(got, want)
