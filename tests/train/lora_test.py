"""LoRA (train.lora.*): the adapter maths against merged weights, a step that trains only the
adapters, rank 0 unchanged, mesh layouts, the int8 base and bad input."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import lora_checkpoint, peft_io, safetensors_io
from dlmjax.model import layers, lora
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import rollout
from dlmjax.train import lora_setup, memory, stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config

_ALL = 'q,k,v,o,gate,up,down'


def _config(**overrides):
  return tiny_test_config(
    **{
      'stage': 'sft',
      'init_from': 'unused',  # validation only: init_state draws a random base
      'mesh.fsdp': 1,
      'train.warmup_steps': 0,
      'train.lora.rank': 4,
      'train.lora.alpha': 8.0,
      'train.lora.base_dtype': 'float32',
      **overrides,
    }
  )


def _random_adapters(shapes, seed=1):
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree.map(lambda s: 0.2 * jax.random.normal(next(keys), s.shape), shapes)


def _tiny_model_config(**lora_fields):
  cfg = model_lib.ModelConfig(
    num_layers=2,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab_size=64,
    seq_len=16,
  )
  return cfg, dataclasses.replace(cfg, **lora_fields)


def test_merged_weights_give_the_adapter_models_logits():
  """x W + (alpha / r)(x A) B on every target equals x (W + (alpha / r) A B) in float32."""
  base_cfg, cfg = _tiny_model_config(
    lora_rank=4, lora_alpha=8.0, lora_targets=tuple(_ALL.split(','))
  )
  base = model_lib.init_params(base_cfg, jax.random.key(0))
  adapters = _random_adapters(lora.split(model_lib.abstract(cfg)[1])[0])
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
  adapted = model_lib.merge(cfg, lora.combine(adapters, base))(tokens)
  merged_params = lora.merge_into_base(lora.combine(adapters, base), cfg.lora_spec)
  merged = model_lib.merge(base_cfg, merged_params)(tokens)
  plain = model_lib.merge(base_cfg, base)(tokens)
  assert float(jnp.abs(adapted - plain).max()) > 0.1  # the adapters do change the function
  np.testing.assert_allclose(adapted, merged, rtol=0, atol=2e-5)


def test_int8_base_logits_stay_within_tolerance_of_the_float32_base():
  """Per-channel int8 weights: logits within 2% of the float32 model's spread."""
  base_cfg, cfg = _tiny_model_config(weight_quant='int8')
  base = model_lib.init_params(base_cfg, jax.random.key(0))
  frozen = lora.freeze(base, cfg, jnp.float32)
  assert frozen['blocks']['attn']['q_proj'].dtype == jnp.int8
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
  want = model_lib.merge(base_cfg, base)(tokens)
  got = model_lib.merge(cfg, frozen)(tokens)
  error = float(jnp.abs(got - want).max() / jnp.std(want))
  assert 0 < error < 0.02, error


def _step(config, steps=1, devices=None):
  devices = devices or jax.devices()[:1]
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, devices))
  stage = stages.build(config)
  batch = stage.example_batch(np.random.default_rng(0))
  step_fn = step_lib.CompiledStep(setup, stage)
  state = setup.init_state(config.seed)
  before = jax.device_get(state['params'])
  batch = {k: jax.device_put(v, step_fn.batch_sharding) for k, v in batch.items()}
  metrics = []
  for _ in range(steps):
    state, m = step_fn(state, batch)
    metrics.append(jax.device_get(m))
  return setup, before, jax.device_get(state), metrics, stage, batch


def test_a_lora_step_trains_the_adapters_alone_with_the_gradient_of_the_merged_model():
  """The state, gradient and optimizer state are the adapters'; the first step moves B only
  (dL/dA is zero while B is); the gradient norm is that of the loss of the merged weights
  W + (alpha / r) A B with respect to A and B."""
  config = _config(**{'train.micro_batch_size': 16, 'train.weight_decay': 0.0})
  setup, before, state, metrics, stage, batch = _step(config)
  names = [str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(state['params'])[0]]
  assert names and all(lora.is_adapter(n) for n in names)
  adam = jax.tree.leaves(state['opt_state'])
  assert sum(x.size for x in adam) == 2 * sum(x.size for x in jax.tree.leaves(before)) + 2
  for path, a, b in lora.adapted_weights(state['params']):
    a0 = before['blocks'][path[1]][path[2] + lora.A_SUFFIX]
    np.testing.assert_array_equal(a, a0)
    assert np.abs(b).max() > 0
  # The reference gradient: through merged weights, on the same batch and randomness.
  cfg, base = setup.model_config, setup.frozen
  base_cfg = dataclasses.replace(cfg, lora_rank=0, lora_targets=())

  def merged_loss(adapters):
    params = jax.tree.map(lambda x: x, base)
    for path, a, b in lora.adapted_weights(adapters):
      node = params['blocks'][path[1]]
      node[path[2]] = node[path[2]] + lora.delta(a, b, lora.contract_ndim_of(path[2]), 2.0)
    module = model_lib.merge(base_cfg, params)
    ids = jnp.arange(16)
    return stage.loss(module, step=jnp.int32(0), micro_index=0, example_ids_B=ids, **batch)[0]

  adapters = jax.tree.map(jnp.asarray, before)
  grads = jax.jit(jax.grad(merged_loss))(adapters)
  want = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
  np.testing.assert_allclose(metrics[0]['grad_norm'], want, rtol=1e-4)


@pytest.mark.slow  # two 2-step runs (~60 s on the shared 2 cores)
def test_rank_zero_is_the_full_model_bit_for_bit():
  """rank 0 ignores every other train.lora key: the same model config, params and losses."""
  plain = tiny_test_config(**{'stage': 'sft', 'init_from': 'unused', 'mesh.fsdp': 1})
  odd = _config(
    **{'train.lora.rank': 0, 'train.lora.targets': 'q', 'train.lora.base_dtype': 'int8'}
  )
  odd.train.warmup_steps = plain.train.warmup_steps
  setup_a, _, state_a, metrics_a, _, _ = _step(plain, steps=2)
  setup_b, _, state_b, metrics_b, _, _ = _step(odd, steps=2)
  assert setup_b.model_config == model_lib.ModelConfig.from_config(plain, pipeline=True)
  assert not setup_b.lora and setup_b.frozen == {}
  assert [m['loss'] for m in metrics_a] == [m['loss'] for m in metrics_b]
  jax.tree.map(np.testing.assert_array_equal, state_a['params'], state_b['params'])


@functools.lru_cache
def _one_device_two_steps():
  """(state, metrics) of two steps of _config() on one device: both layouts' reference."""
  _, _, state, metrics, _, _ = _step(_config(), steps=2)
  return state, metrics


@pytest.mark.slow  # one device and eight, then two pipeline stages (~120 s on 2 cores)
@pytest.mark.parametrize(
  'layout, devices',
  [({'mesh.fsdp': 4, 'mesh.tensor': 2}, 8), ({'mesh.pipeline': 2, 'model.remat': 'full'}, 2)],
)
def test_lora_on_a_mesh_equals_one_device(layout, devices):
  """Adapters sharded like their weights (fsdp x tensor; pipeline stages, remat): the same
  losses and adapters as one device."""
  state_1, metrics_1 = _one_device_two_steps()
  _, _, state_n, metrics_n, _, _ = _step(
    _config(**layout), steps=2, devices=jax.devices()[:devices]
  )
  for a, b in zip(metrics_1, metrics_n):
    np.testing.assert_allclose(a['loss'], b['loss'], rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    state_1['params'],
    state_n['params'],
  )


@pytest.mark.parametrize(
  'overrides, message',
  [
    ({'train.lora.targets': 'q,attn'}, "names ['attn']; use a comma-separated subset"),
    ({'train.lora.rank': 40}, "rank=40 exceeds the k projection's width 32"),
    ({'init_from': ''}, 'set --config.init_from'),
    ({'train.lora.base_dtype': 'int3'}, 'train.lora.base_dtype'),
    ({'train.lora.base_dtype': 'nf4', 'model.ffn_dim': 96}, 'model.ffn_dim=96 is not even'),
    ({'train.lora.dropout': 1.0}, 'train.lora.dropout=1.0 must be in [0, 1)'),
    ({'train.lora.dropout': 0.05, 'mesh.pipeline': 2}, 'set --config.mesh.pipeline=1'),
  ],
)
def test_bad_lora_settings_fail_with_one_line_naming_the_fix(overrides, message):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(_config(**overrides))
  assert message in str(e.value) and '\n' not in str(e.value)


def test_memory_counts_the_frozen_base_and_the_adapters_state():
  """state = base in its dtype + 20 bytes per adapter parameter (accumulating: 2 micro-batches)."""

  def state(**overrides):
    config = _config(**{'model.dtype': 'bfloat16', **overrides})
    config_lib.fit_to_devices(config, 1)
    return memory.estimate_bytes_per_device(config)['state']

  cfg = model_lib.ModelConfig.from_config(_config())
  adapters = 2 * 4 * sum(i + o for i, o in config_lib.projection_widths(cfg).values())
  assert state(**{'train.lora.base_dtype': 'bfloat16'}) == 2 * cfg.num_params() + 20 * adapters
  widths = config_lib.projection_widths(cfg)
  per_layer = sum(i * o for i, o in widths.values())
  scales = 2 * sum(o for _, o in config_lib.projection_widths(cfg).values())
  int8 = state(**{'train.lora.base_dtype': 'int8'})
  assert int8 == 2 * cfg.num_params() - 2 * per_layer + 2 * scales + 20 * adapters
  # 4 bits: half a byte per projection weight and a bf16 absmax per block of its last input axis.
  blocks = {n: o * i / min(64, cfg.head_dim if n == 'o' else i) for n, (i, o) in widths.items()}
  nf4 = state(**{'train.lora.base_dtype': 'nf4'})
  layers = cfg.num_layers
  want = 2 * cfg.num_params() - layers * (1.5 * per_layer - 2 * sum(blocks.values()))
  assert nf4 == pytest.approx(want + 20 * adapters) and nf4 < int8
  assert state(**{'train.lora.rank': 0}) == 20 * cfg.num_params()


def test_the_rl_reference_is_the_base_with_the_adapters_off():
  """No second copy: the reference holds the frozen base itself and scores it with the model
  config without adapters; that equals the adapter model while B is zero, and not after."""
  rl = {'rl.max_prompt_tokens': 16, 'sampler.gen_length': 16, 'sampler.block_length': 16}
  config = _config(**{'stage': 'rl', 'rl.kl_beta': 0.04, 'sampler.steps': 2, **rl})
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  state = setup.init_state(config.seed)
  reference = reference_lib.ReferenceModel(config, setup)
  assert reference.params() is setup.frozen and reference.model_config.lora_rank == 0
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 200, (4, 32)).astype(np.int32)
  prompt_lengths, lengths = np.full(4, 8, np.int32), np.full(4, 32, np.int32)
  seeds = np.arange(4, dtype=np.int32)
  score = rollout.make_score_fn(config, setup.model_config)
  ref_score = rollout.make_score_fn(config, reference.model_config)
  want = ref_score(reference.params(), tokens, prompt_lengths, lengths, seeds)
  fresh = score(setup.model_params(state['params']), tokens, prompt_lengths, lengths, seeds)
  np.testing.assert_array_equal(fresh, want)
  trained = _random_adapters(setup.trainable_shapes)
  moved = score(setup.model_params(trained), tokens, prompt_lengths, lengths, seeds)
  assert np.abs(np.asarray(moved) - np.asarray(want)).max() > 1e-3


def _write_peft(directory, adapters, cfg, family):
  """A PEFT directory in `family`'s module names (LLaDA's: d1's adapters)."""
  os.makedirs(directory, exist_ok=True)
  tensors = list(peft_io.adapter_tensors(adapters, cfg, family))
  entries = [(n, t.shape, t.dtype) for n, t in tensors]
  safetensors_io.write_model(
    str(directory), entries, iter(tensors), max_shard_bytes=1 << 40,
    single_file=peft_io.WEIGHTS_FILE,
  )  # fmt: skip
  with open(os.path.join(directory, peft_io.CONFIG_FILE), 'w') as f:
    json.dump(dict(peft_type='LORA', r=cfg.lora_rank, lora_alpha=cfg.lora_alpha), f)
  return str(directory)


def test_a_peft_adapter_with_llada_names_loads_and_one_that_does_not_fit_is_refused(tmp_path):
  config = _config(**{'train.lora.targets': 'q,k,v,up'})  # what d1's adapters match in LLaDA
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  adapters = jax.device_get(_random_adapters(setup.trainable_shapes))
  d1 = _write_peft(tmp_path / 'd1', adapters, setup.model_config, 'llada')
  back = jax.device_get(peft_io.read_adapter(d1, config, setup))
  jax.tree.map(np.testing.assert_array_equal, back, adapters)
  wider = _config(**{'train.lora.targets': 'q,k,v,up', 'model.ffn_dim': 192})
  wide_setup = state_lib.TrainSetup(wider, setup.mesh)
  wide = _write_peft(
    tmp_path / 'wide',
    jax.device_get(_random_adapters(wide_setup.trainable_shapes)),
    wide_setup.model_config,
    'llama',
  )
  with pytest.raises(config_lib.ConfigError, match=r'lora_B of up is \(192, 4\)') as e:
    peft_io.read_adapter(wide, config, setup)
  assert '\n' not in str(e.value)


def test_a_resume_checks_an_unchanged_base_by_its_files_and_a_changed_one_by_its_arrays(
  tmp_path, monkeypatch
):
  """lora_base.json keeps the base's checksum and its files' fingerprint: unchanged files (names,
  sizes, mtimes) skip the hash; touched files are hashed and, with the same arrays, accepted and
  the fingerprint renewed; rewritten files with other arrays are refused in one line."""
  base, run = tmp_path / 'base', tmp_path / 'run'
  base.mkdir(), run.mkdir()
  weights = base / 'model.safetensors'
  weights.write_bytes(b'x' * 64)
  frozen = {'w': jnp.arange(8.0)}
  lora_setup.record_or_check_base(str(run), str(base), frozen, resuming=False)
  hashed = []
  real = lora_checkpoint.base_checksum
  monkeypatch.setattr(lora_checkpoint, 'base_checksum', lambda f: hashed.append(1) or real(f))
  lora_setup.record_or_check_base(str(run), str(base), frozen, resuming=True)
  assert hashed == []
  mtime = os.stat(weights).st_mtime_ns
  os.utime(weights, ns=(mtime + 10**9, mtime + 10**9))
  lora_setup.record_or_check_base(str(run), str(base), frozen, resuming=True)
  lora_setup.record_or_check_base(str(run), str(base), frozen, resuming=True)
  assert hashed == [1]  # once: the renewed fingerprint holds again
  weights.write_bytes(b'y' * 65)
  with pytest.raises(config_lib.ConfigError, match='the LoRA base changed') as e:
    lora_setup.record_or_check_base(str(run), str(base), {'w': jnp.arange(8.0) + 1}, resuming=True)
  assert '\n' not in str(e.value)


def test_adapter_dropout_is_the_hand_written_mask_on_the_adapters_input_only():
  """Under the train step's context, y = x W + f ((x * m / (1 - p)) A) B with m ~ Bernoulli(1 - p)
  drawn from fold_in(fold_in(step key, layer), projection); outside it (evaluation, sampling)
  y = x W + f (x A) B. W = 0 and A = B = I expose the dropped input itself."""
  x = jax.random.normal(jax.random.key(0), (2, 64, 8))
  w, eye = jnp.zeros((8, 8)), jnp.eye(8)
  key, rate = lora.dropout_key(0, jnp.int32(3), 1), 0.25

  def up(dropout_on):
    if not dropout_on:
      return layers.project('bld,df->blf', x, w, 'compute', adapter=(eye, eye, 1.0, None))
    with lora.dropout(key, rate), lora.dropout_layer(2):
      adapter = (eye, eye, 1.0, lora.projection_dropout('up_proj'))
      return layers.project('bld,df->blf', x, w, 'compute', adapter=adapter)

  got = up(True)
  layer_key = jax.random.fold_in(key, 2)
  keep = jax.random.bernoulli(jax.random.fold_in(layer_key, lora.PROJECTIONS.index('up_proj')),
                              1 - rate, x.shape)  # fmt: skip
  np.testing.assert_allclose(got, np.where(keep, x / (1 - rate), 0), rtol=1e-6)
  assert 0.65 < float(keep.mean()) < 0.85
  np.testing.assert_array_equal(up(False), x)  # off outside the step
  with lora.dropout(key, 0.0):
    assert lora.projection_dropout('up_proj') is None


@pytest.mark.slow  # two 2-step tiny runs (~30 s on 2 idle cores)
def test_adapter_dropout_changes_the_step_only_through_the_adapters():
  """Step 1 (B = 0: the adapters add exactly 0) has the same loss with and without dropout; step
  2 does not; the same seed draws the same masks."""
  runs = {}
  for rate in (0.0, 0.5):
    config = _config(**{'train.lora.dropout': rate, 'train.lr': 1e-2})
    runs[rate] = [float(m['loss']) for m in _step(config, steps=2)[3]]
  np.testing.assert_allclose(runs[0.0][0], runs[0.5][0], rtol=1e-6)
  assert abs(runs[0.0][1] - runs[0.5][1]) > 1e-4, runs
