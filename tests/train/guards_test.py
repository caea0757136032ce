"""Run-time faults inside the loop, without compiling a real step: bad token ids, a vanished data
file, too little disk, device out-of-memory; errors leave only complete checkpoints behind."""

import dataclasses
import errno
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from dlmjax.data.errors import DataError
from dlmjax.train import guards, loop, stages
from dlmjax.train.stages import base
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config


def _config(output_dir, **overrides):
  c = tiny_test_config(
    **{
      'train.steps': 8,
      'checkpoint.every': 2,
      'checkpoint.keep': 5,
      'log.outputs': 'tensorboard',
      **overrides,
    }
  )
  c.output_dir = str(output_dir)
  if os.environ.get('DLMJAX_CACHE_DIR'):
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return c


def test_check_token_ids_matches_a_plain_reference():
  rng = np.random.default_rng(0)
  config = _config('unused')
  vocab = config.model.vocab_size
  for trial in range(20):
    tokens = rng.integers(0, vocab, size=(4, 9))
    bad_count = trial % 4
    cells = rng.choice(tokens.size, size=bad_count, replace=False)
    tokens.reshape(-1)[cells] = rng.choice([-1, vocab, vocab + 7], size=bad_count)
    if bad_count == 0:
      guards.check_token_ids(tokens, config, step=3)
      continue
    first = min(cells)  # row-major: the first bad id the message reports
    row, position = divmod(int(first), tokens.shape[1])
    with pytest.raises(DataError) as info:
      guards.check_token_ids(tokens, config, step=3)
    message = str(info.value)
    assert f'{bad_count} token ids outside [0, {vocab})' in message
    assert f'first {tokens[row, position]} at row {row}, position {position}' in message
    assert 'step 3' in message and "data.source 'builtin'" in message


def test_a_vanished_data_file_is_named():
  def vanishing():
    yield {'tokens': np.zeros((2, 3), np.int32)}
    raise FileNotFoundError(errno.ENOENT, 'No such file or directory', '/data/web_text.bin')

  batches = base.DataBatches(vanishing())
  config = _config('unused')
  batch, row = guards.next_batch(batches, None, config, step=1)
  assert batch['tokens'].shape == (2, 3) and row is None
  with pytest.raises(DataError, match='step 2 failed: /data/web_text.bin: No such file'):
    guards.next_batch(batches, None, config, step=2)


def test_checkpoint_bytes_and_free_disk(monkeypatch, tmp_path):
  shapes = {
    'a': jax.ShapeDtypeStruct((3, 5), jnp.float32),
    'b': [jax.ShapeDtypeStruct((7,), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32)],
  }
  assert guards.checkpoint_bytes(shapes) == 3 * 5 * 4 + 7 * 2 + 4
  usage = types.SimpleNamespace(total=10**9, used=0, free=80)
  monkeypatch.setattr(guards.shutil, 'disk_usage', lambda path: usage)
  with pytest.raises(guards.ResourceError, match='1 checkpoints of this run'):
    guards.check_free_disk(str(tmp_path), shapes)  # 78 bytes * 1.1 > 80
  usage.free = 86
  assert 'holds the 1 checkpoints' in guards.check_free_disk(str(tmp_path), shapes)
  # keep + 1 copies: 4 x 85 bytes do not fit in 300, but do with this run's 40 bytes on disk.
  usage.free = 300
  with pytest.raises(guards.ResourceError, match='4 checkpoints of this run'):
    guards.check_free_disk(str(tmp_path), shapes, copies=4)
  (tmp_path / 'checkpoints' / '1').mkdir(parents=True)
  (tmp_path / 'checkpoints' / '1' / 'x').write_bytes(b'0' * 40)
  guards.check_free_disk(str(tmp_path), shapes, copies=4)


def test_checkpoints_on_disk_counts_keep_plus_one_and_milestones():
  config = tiny_test_config(**{'checkpoint.keep': 3, 'train.steps': 100})
  assert guards.checkpoints_on_disk(config) == 4
  config.checkpoint.keep_every = 30
  assert guards.checkpoints_on_disk(config) == 7


class _FakeStep:
  """Stands in for CompiledStep: counts steps, reports a fixed loss, compiles nothing heavy."""

  fail_at = None

  def __init__(self, setup, stage):
    del stage
    self.batch_sharding = step_lib.rules.named_sharding(setup.mesh, (step_lib.rules.BATCH, None))

  def __call__(self, state, batch):
    del batch
    step = int(state['step']) + 1
    if step == self.fail_at:
      raise jax.errors.JaxRuntimeError(
        'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.14GiB.'
      )
    one = jnp.float32(1.0)
    metrics = dict(
      skipped=0 * one,
      loss=one,
      masked_ce=one,
      mask_ratio=one,
      real_input_length=one,
      tokens=one,
      grad_norm=one,
      lr=one,
    )
    return dict(state, step=state['step'] + 1), metrics


@pytest.fixture
def fake_step(monkeypatch):
  """No compiled step and a zero state placed without compiling the real initialiser."""
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel

  def zero_state(setup, seed):
    del seed
    return jax.tree.map(
      lambda s, sharding: jax.device_put(np.zeros(s.shape, s.dtype), sharding),
      setup.state_shapes,
      setup.state_shardings,
    )

  monkeypatch.setattr(step_lib, 'CompiledStep', _FakeStep)
  monkeypatch.setattr(state_lib.TrainSetup, 'init_state', zero_state)


def _fake_stage(bad_step, fault):
  """The pre-training stage whose batch source applies `fault` to its bad_step-th batch."""
  pretrain = stages.BUILDERS['pretrain']

  def build(config):
    stage = pretrain(config)

    def batches(setup, process_index, process_count):
      inner = stage.batches(setup, process_index, process_count)

      class Faulty:
        consumed = 0

        def next(self, params):
          self.consumed += 1
          batch, row = inner.next(params)
          return (fault(batch) if self.consumed == bad_step else batch), row

        def get_state(self):
          return inner.get_state()

        def set_state(self, state):
          inner.set_state(state)

      return Faulty()

    return dataclasses.replace(stage, batches=batches)

  return build


def _vanish(batch):
  del batch
  raise FileNotFoundError(errno.ENOENT, 'No such file or directory', '/data/shard_7.bin')


def _out_of_vocab(batch):
  tokens = batch['tokens'].copy()
  tokens[1, 4] = 10**6
  return dict(batch, tokens=tokens)


@pytest.mark.parametrize(
  'fault,message',
  [
    (_vanish, '/data/shard_7.bin'),
    (_out_of_vocab, 'first 1000000 at row 1, position 4'),
  ],
)
def test_bad_data_mid_run_keeps_only_complete_checkpoints(
  tmp_path, monkeypatch, fake_step, fault, message
):
  monkeypatch.setitem(stages.BUILDERS, 'pretrain', _fake_stage(5, fault))
  config = _config(tmp_path)
  with pytest.raises(DataError, match=message):
    loop.train(config)
  # Saved before the fault: 2 and 4, each complete and restorable; nothing of step 5.
  steps = sorted(os.listdir(tmp_path / 'checkpoints'))
  assert steps == ['2', '4'], steps
  _, step_dir, step = run_dir_lib.resolve_step_dir(str(tmp_path))
  assert step == 4 and step_meta.read_meta(step_dir)['step'] == 4


def test_out_of_memory_names_the_knobs(tmp_path, monkeypatch, fake_step):
  monkeypatch.setattr(_FakeStep, 'fail_at', 3)
  with pytest.raises(guards.ResourceError) as info:
    loop.train(_config(tmp_path))
  message = str(info.value)
  for knob in ('train.micro_batch_size', 'model.remat', 'mesh.fsdp', '3.14GiB'):
    assert knob in message
  # Other runtime errors pass through untouched.
  with pytest.raises(jax.errors.JaxRuntimeError, match='INTERNAL'):
    with guards.explain_out_of_memory():
      raise jax.errors.JaxRuntimeError('INTERNAL: something else')


def test_too_little_disk_is_reported_before_training(tmp_path, monkeypatch):
  monkeypatch.setattr(
    guards.shutil, 'disk_usage', lambda path: types.SimpleNamespace(total=1, used=1, free=1000)
  )
  with pytest.raises(guards.ResourceError, match='has 0.00 GiB free.*checkpoint.keep'):
    loop.train(_config(tmp_path))
  assert not os.path.exists(tmp_path / 'metrics.jsonl')
  assert not os.path.exists(tmp_path / 'checkpoints')  # refused before the manager starts


@pytest.mark.parametrize(
  'documents,message',
  [
    ([[5, 6, 2]], r'corpus holds 1 sequences and 3 tokens, too few for one sample'),
    ([[]], r'train split of .*corpus is empty'),
  ],
)
def test_a_dataset_empty_after_filtering_names_the_file(tmp_path, documents, message):
  from dlmjax.data import indexed, pipeline  # pylint: disable=import-outside-toplevel

  prefix = str(tmp_path / 'corpus')
  with indexed.IndexedDatasetWriter(prefix) as writer:
    for document in documents:
      writer.add_document(np.array(document, np.int64))
  config = _config(tmp_path, **{'data.source': 'megatron', 'data.train_prefixes': prefix})
  config.data.cache_dir = str(tmp_path / 'cache')
  with pytest.raises(DataError, match=message):
    pipeline.make_batch_iterator(config)


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'data.source': 'megatron', 'data.train_prefixes': ''}, 'no data prefixes given'),
    (
      {'data.source': 'megatron', 'data.train_prefixes': '{tmp}/none'},
      r'data.train_prefixes: .*none.idx and .*none.bin not found; .*--config.data.train_prefixes',
    ),
    ({'data.tokenizer': '{tmp}/tok.json'}, r"data.tokenizer '.*tok.json' is not a file; set"),
    ({'stage': 'sft', 'sft.train_file': '{tmp}/sft.jsonl'}, 'sft.train_file .* is not a file'),
    ({'stage': 'sft', 'sft.train_file': 'builtin:sudoku9'}, "'builtin:sudoku9' names no built-in"),
    ({'stage': 'rl', 'rl.task': 'gsm8k', 'rl.task_data': '{tmp}/g.jsonl'}, 'rl.task_data names'),
  ],
)
def test_missing_inputs_fail_before_the_run_directory_exists(tmp_path, overrides, message):
  overrides = {k: v.replace('{tmp}', str(tmp_path)) for k, v in overrides.items()}
  config = _config(tmp_path / 'run', **overrides)
  with pytest.raises(DataError, match=message):
    loop.train(config)
  assert not os.path.exists(tmp_path / 'run')


@pytest.mark.parametrize(
  'suffix,message', [('.bin', r'c\.bin has .* bytes'), ('.idx', r'c\.idx is')]
)
def test_truncated_data_files_fail_before_the_model_is_built(
  tmp_path, suffix, message, monkeypatch
):
  from dlmjax.data import indexed  # pylint: disable=import-outside-toplevel

  with indexed.IndexedDatasetWriter(str(tmp_path / 'c')) as writer:
    writer.add_document(np.arange(50))
  path = tmp_path / f'c{suffix}'
  path.write_bytes(path.read_bytes()[:-7])
  built = []
  monkeypatch.setattr(loop.state_lib, 'TrainSetup', lambda *a: built.append(a))
  config = _config(
    tmp_path / 'run', **{'data.source': 'megatron', 'data.train_prefixes': str(tmp_path / 'c')}
  )
  with pytest.raises(DataError, match=message):
    loop.train(config)
  assert not built and not os.path.exists(tmp_path / 'run')


def test_present_inputs_pass(tmp_path):
  from dlmjax.data import indexed  # pylint: disable=import-outside-toplevel

  with indexed.IndexedDatasetWriter(str(tmp_path / 'c')) as writer:
    writer.add_document(np.arange(5))
  (tmp_path / 'tok.json').write_text('{}')
  guards.check_inputs(
    _config(
      tmp_path,
      **{
        'data.source': 'megatron',
        'data.train_prefixes': f'1 {tmp_path}/c 2 {tmp_path}/c',
        'data.tokenizer': str(tmp_path / 'tok.json'),
      },
    )
  )


def test_a_failed_start_leaves_no_run_directory(tmp_path):
  config = _config(tmp_path / 'run', **{'mesh.data': 3})  # refused after the directory is made
  with pytest.raises(Exception, match='mesh'):
    loop.train(config)
  assert not os.path.exists(tmp_path / 'run')
  (tmp_path / 'kept').mkdir()  # a directory the user made stays
  config = _config(tmp_path / 'kept', **{'mesh.data': 3})
  with pytest.raises(Exception, match='mesh'):
    loop.train(config)
  assert os.path.isdir(tmp_path / 'kept')
