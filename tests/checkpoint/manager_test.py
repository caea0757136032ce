"""RunCheckpoints: every saved item checksummed (damage sets a step aside, with one warning, and
the previous one restores), a step of another model refused untouched, the restored state
bitwise the saved one on other meshes, a full disk ending in one error."""

import os
import re

import jax
import numpy as np
import pytest

from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import manager
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import state as state_lib
from tests.checkpoint import tiny_run
from tests.conftest import tiny_test_config


def _setup(**overrides):
  # vocab 4200: padded to 4224 on every mesh (4352 if the padding followed mesh.tensor = 2).
  config = tiny_test_config(**{'model.num_layers': 2, 'model.vocab_size': 4200, **overrides})
  return state_lib.TrainSetup(config, mesh_lib.make_mesh(config))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A run directory with checkpoints 1 and 2 (random states) saved on fsdp 8; (dir, states)."""
  run_dir = tmp_path_factory.mktemp('run')
  setup = _setup(**{'mesh.fsdp': 8})
  checkpoints = manager.RunCheckpoints(str(run_dir), keep=3)
  states = {}
  for step in (1, 2):
    state = setup.init_state(step)
    # Moments that are not all zeros, so a flipped byte of the optimizer state changes values.
    key = jax.random.key(step)
    noise = jax.tree.map(
      lambda x: x + jax.random.normal(key, x.shape) if x.dtype == np.float32 else x,
      state['opt_state'],
    )
    state = dict(state, step=jax.numpy.int32(step), opt_state=noise)
    checkpoints.save(state, data_state={'epoch': 0, 'index': 16 * step})
    states[step] = jax.device_get(state)
  checkpoints.close()
  return run_dir, states


def _copy(saved, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel

  shutil.copytree(saved[0], tmp_path / 'run')
  return tmp_path / 'run'


def _assert_equal(a, b):
  for (path, x), (_, y) in zip(
    jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
  'mesh',
  [{'mesh.fsdp': 8}, {'mesh.fsdp': 4, 'mesh.tensor': 2}, {'mesh.pipeline': 2, 'mesh.fsdp': 4}],
)
def test_restore_on_another_mesh_is_bitwise_the_saved_state(saved, mesh, capsys):
  checkpoints = manager.RunCheckpoints(str(saved[0]))
  state, data_state = checkpoints.restore_latest(_setup(**mesh))  # checksums verified inside
  checkpoints.close()
  assert data_state == {'epoch': 0, 'index': 32}
  _assert_equal(jax.device_get(state), saved[1][2])
  assert 'warning' not in capsys.readouterr().err


@pytest.mark.parametrize(
  'damage, named',
  [
    (lambda d: tiny_run.flip_bytes(os.path.join(d, 'params')), 'params/'),
    (lambda d: tiny_run.flip_bytes(os.path.join(d, 'opt_state')), 'opt_state/'),
    # One line naming the status, the array and the file, not a cut TensorStore repr.
    (
      lambda d: tiny_run.truncate_arrays(os.path.join(d, 'params')),
      'reading the arrays failed: ValueError: OUT_OF_RANGE: Error reading "',
    ),
    (lambda d: tiny_run.edit_meta(d, data_state={'epoch': 0, 'index': 48}), 'data-iterator state'),
    (lambda d: tiny_run.edit_meta(d, step=7), 'step (7)'),
    (lambda d: open(os.path.join(d, 'meta', 'metadata'), 'w').write('{"st'), 'meta: '),
    # A meta written with checksums that lost them is damaged, not a checkpoint from before.
    (lambda d: tiny_run.edit_meta(d, drop=['checksums']), 'checksums missing'),
    (lambda d: tiny_run.edit_meta(d, drop=['checksum_format']), 'checksum_format missing'),
    (lambda d: tiny_run.edit_meta(d, drop=['meta_checksum']), 'meta_checksum missing'),
    (lambda d: tiny_run.edit_meta(d, drop=['opt_state_checksums']), 'opt_state_checksums missing'),
    (
      lambda d: tiny_run.edit_meta(
        d, drop=['checksums', 'checksum_format', 'meta_checksum', 'layout']
      ),
      'checksums, checksum_format, meta_checksum missing',
    ),
    (lambda d: tiny_run.edit_meta(d, checksum_format='none'), "checksum_format 'none'"),
  ],
  ids=[
    'params',
    'opt_state',
    'params_truncated',
    'data_state',
    'step',
    'meta_truncated',
    'no_checksums',
    'no_checksum_format',
    'no_meta_checksum',
    'no_opt_state_checksums',
    'all_but_the_marker',
    'unknown_format',
  ],
)
def test_damage_to_any_item_sets_the_step_aside_and_the_previous_restores(
  saved, tmp_path, capsys, damage, named
):
  run_dir = _copy(saved, tmp_path)
  damage(str(run_dir / 'checkpoints' / '2'))
  checkpoints = manager.RunCheckpoints(str(run_dir))
  state, data_state = checkpoints.restore_latest(_setup(**{'mesh.fsdp': 8}))
  checkpoints.close()
  assert data_state == {'epoch': 0, 'index': 16}
  _assert_equal(jax.device_get(state), saved[1][1])
  (warning,) = capsys.readouterr().err.strip().splitlines()
  assert warning.startswith(f'warning: checkpoint {run_dir}/checkpoints/2: ') and named in warning
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['1', '2.corrupt']


def test_a_checkpoint_from_before_checksums_loads_and_says_so(saved, tmp_path, capsys):
  run_dir = _copy(saved, tmp_path)
  step_dir = run_dir / 'checkpoints' / '2'
  integrity = ['checksums', 'checksum_format', 'meta_checksum', 'opt_state_checksums']
  tiny_run.edit_meta(str(step_dir), drop=integrity + ['layout', 'format'])
  checkpoints = manager.RunCheckpoints(str(run_dir))
  state, _ = checkpoints.restore_latest(_setup(**{'mesh.fsdp': 8}))
  checkpoints.close()
  _assert_equal(jax.device_get(state), saved[1][2])
  out = capsys.readouterr()
  assert f'checkpoint {step_dir} predates checksums: its arrays load unverified.' in out.out
  assert 'warning' not in out.err


def test_all_set_aside_refuses_instead_of_starting_afresh(saved, tmp_path):
  run_dir = _copy(saved, tmp_path)
  for step in ('1', '2'):
    tiny_run.flip_bytes(str(run_dir / 'checkpoints' / step / 'params'))
  checkpoints = manager.RunCheckpoints(str(run_dir))
  with pytest.raises(run_dir_lib.CheckpointError, match='no usable checkpoint'):
    checkpoints.restore_latest(_setup(**{'mesh.fsdp': 8}))
  checkpoints.close()
  checkpoints = manager.RunCheckpoints(str(run_dir))  # the same command again
  with pytest.raises(run_dir_lib.CheckpointError) as e:
    checkpoints.refuse_if_only_set_aside()
  checkpoints.close()
  message = str(e.value)
  assert f'every checkpoint in {run_dir}/checkpoints was set aside' in message, message
  assert '1.corrupt, 2.corrupt' in message and 'move the *.corrupt' in message
  assert '\n' not in message


def test_a_step_of_another_model_is_refused_and_left_alone(saved, tmp_path):
  run_dir = _copy(saved, tmp_path)
  checkpoints = manager.RunCheckpoints(str(run_dir))
  with pytest.raises(run_dir_lib.CheckpointError, match='other shapes') as e:
    checkpoints.restore_latest(_setup(**{'mesh.fsdp': 8, 'model.ffn_dim': 256}))
  checkpoints.close()
  assert '\n' not in str(e.value)
  pattern = r'\(params/blocks/mlp/\w+: checkpoint float32\[[^]]*128[^]]*\], run float32\['
  assert re.search(pattern, str(e.value)), str(e.value)
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['1', '2']


def test_a_full_disk_mid_save_names_the_knobs_and_keeps_the_last_checkpoint(
  saved, tmp_path, monkeypatch
):
  run_dir = _copy(saved, tmp_path)
  monkeypatch.setenv(manager.DISK_FULL_ENV, '3')
  checkpoints = manager.RunCheckpoints(str(run_dir), keep=2)
  setup = _setup(**{'mesh.fsdp': 8})
  state = dict(setup.init_state(3), step=jax.numpy.int32(3))
  with pytest.raises(manager.DiskFullError) as e:
    checkpoints.save(state, data_state=None)
    checkpoints.wait()
  checkpoints.close()
  message = str(e.value)
  assert '\n' not in message
  for part in (
    f'{run_dir}/checkpoints',
    'checkpoint 3 ran out of space',
    'GiB',
    'checkpoint.keep',
    'checkpoint.every',
    'output_dir',
    f'last complete checkpoint is {run_dir}/checkpoints/2',
  ):
    assert part in message, message
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['1', '2']  # no partial save left


def test_saves_from_an_import_verify(tmp_path):
  _, params, step_dir = tiny_run.make_run(tmp_path)
  meta = step_meta.read_meta(step_dir)
  assert step_meta.saved_checksums(meta) == checksums.compute(params)
  assert step_meta.saved_checksums({'checksums': {'a': 'f' * 64}}) is None  # an older format


def test_set_aside_renames_without_clobbering(tmp_path):
  tiny_run.make_run(tmp_path)
  checkpoints = manager.RunCheckpoints(str(tmp_path))
  (tmp_path / 'checkpoints' / '0.corrupt').mkdir()
  assert checkpoints._set_aside(0) == '0.corrupt1'  # pylint: disable=protected-access
  assert (tmp_path / 'checkpoints' / '0.corrupt1').is_dir()
  assert checkpoints.latest_step() is None
  checkpoints.close()
