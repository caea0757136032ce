"""The loop end to end on the built-in corpus: run directory, exact resume, clear failures."""

import json
import os

import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from dlmjax.train import loop
from tests.train import faults
from tests.conftest import tiny_test_config


def _config(output_dir, **overrides):
  c = tiny_test_config(
    **{
      'train.steps': 20,
      'checkpoint.every': 8,
      'checkpoint.keep': 2,
      'diffusion.varlen_prob': 0.2,
      **overrides,
    }
  )
  c.output_dir = str(output_dir)
  if os.environ.get('DLMJAX_CACHE_DIR'):
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return c


def _losses(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return {row['step']: row['loss'] for row in map(json.loads, f)}


@pytest.fixture(scope='module')
def straight_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp('straight')
  loop.train(_config(run_dir))
  return run_dir


def test_run_directory_contract(straight_run):
  with open(os.path.join(straight_run, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert [r['step'] for r in rows] == list(range(1, 21))
  for key in ('step', 'loss', 'masked_ce', 'lr', 'grad_norm'):
    assert key in rows[0]
  # Step 1 ran with compilation: no speed for it; the next steps have one.
  assert 'tokens_per_s' not in rows[0] and 'tokens_per_s' in rows[1]
  saved = run_dir_lib.load_run_config(straight_run)
  assert saved.model.d_model == 64
  # keep=2 of the saves at 8, 16, 20.
  assert sorted(os.listdir(os.path.join(straight_run, 'checkpoints'))) == ['16', '20']
  assert rows[-1]['loss'] < rows[0]['loss']


def test_a_finished_run_says_so_and_how_to_go_on(straight_run, tmp_path, capsys):
  import shutil  # pylint: disable=import-outside-toplevel

  shutil.copytree(straight_run, tmp_path / 'run')
  capsys.readouterr()
  assert loop.train(_config(tmp_path / 'run')) is None
  out = capsys.readouterr().out
  assert 'is already at step 20 of 20: nothing to train' in out
  assert '--config.train.steps=40' in out and 'new --config.output_dir' in out
  assert 'first batch' not in out  # nothing compiled, nothing run


def test_resume_refuses_a_different_model(straight_run, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel

  shutil.copytree(straight_run, tmp_path / 'run')
  with pytest.raises(run_dir_lib.CheckpointError, match='model.d_model'):
    loop.train(_config(tmp_path / 'run', **{'model.d_model': 128, 'train.steps': 20}))


def test_resume_on_other_data_is_refused_unless_a_new_phase(straight_run, tmp_path, capsys):
  """The data position counts samples of the checkpoint's data: other data (here another split
  and seq_len) are refused naming the keys; data.new_phase restarts the position explicitly."""
  import shutil  # pylint: disable=import-outside-toplevel

  shutil.copytree(straight_run, tmp_path / 'run')
  other = {'data.split': '900,90,10', 'model.seq_len': 16}
  with pytest.raises(run_dir_lib.CheckpointError) as e:  # (a finished run would just say so)
    loop.train(_config(tmp_path / 'run', **other, **{'train.steps': 22}))
  message = str(e.value)
  assert "data.split: checkpoint '969,30,1', run '900,90,10'; model.seq_len: checkpoint 32" in (
    message
  )
  assert 'data.new_phase=True' in message and '\n' not in message
  loop.train(_config(tmp_path / 'run', **other, **{'data.new_phase': True, 'train.steps': 22}))
  assert 'data.new_phase: the data changed (data.split, model.seq_len); the data position ' in (
    capsys.readouterr().out
  )
  _, step_dir, step = run_dir_lib.resolve_step_dir(str(tmp_path / 'run'))
  data_state = step_meta.read_meta(step_dir)['data_state']
  assert step == 22 and data_state['consumed_samples'] == 2 * 16  # restarted at 0 at step 20
  assert data_state['dataset']['model.seq_len'] == 16
  # The same command again (the switch still set, the data now the checkpoint's): a resume.
  loop.train(_config(tmp_path / 'run', **other, **{'data.new_phase': True, 'train.steps': 22}))
  assert 'data.new_phase' not in capsys.readouterr().out


def test_sigterm_checkpoints_the_step_in_flight_not_one_after(
  straight_run, tmp_path, monkeypatch, capsys
):
  """SIGTERM while the batch of step 5 is read (step 4 in flight): checkpoint 4, whose data
  position excludes the batch read after the signal, and the resume is exact."""
  import signal  # pylint: disable=import-outside-toplevel

  from dlmjax.train import guards  # pylint: disable=import-outside-toplevel

  read = guards.next_batch

  def signalled_on_5(batches, params, config, step):
    if step == 5:
      os.kill(os.getpid(), signal.SIGTERM)
    return read(batches, params, config, step)

  monkeypatch.setattr(guards, 'next_batch', signalled_on_5)
  loop.train(_config(tmp_path))
  assert 'SIGTERM: checkpointing step 4 and stopping' in capsys.readouterr().out
  _, step_dir, step = run_dir_lib.resolve_step_dir(str(tmp_path))
  assert step == 4
  assert step_meta.read_meta(step_dir)['data_state']['consumed_samples'] == 4 * 16
  monkeypatch.setattr(guards, 'next_batch', read)
  loop.train(_config(tmp_path))
  assert _losses(tmp_path) == _losses(straight_run)


def test_init_from_starts_a_new_run(straight_run, tmp_path):
  c = _config(tmp_path, **{'train.steps': 2, 'train.warmup_steps': 0, 'train.wsd_decay_steps': 1})
  c.init_from = str(straight_run)
  row = loop.train(c)
  assert row['step'] == 2
  # Starts from trained weights: its first loss is far below a fresh model's.
  assert _losses(tmp_path)[1] < _losses(straight_run)[1] - 0.5


def test_unwritable_output_dir(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  with pytest.raises(config_lib.ConfigError, match='not writable'):
    loop.train(_config(blocker / 'run'))


def test_smoke_recipe_trains_from_megatron_prefixes_on_the_command_line(tmp_path):
  """configs/pretrain_1p7b.py:smoke reads a Megatron .bin/.idx prefix named by a flag, with
  document-aware packing on (segment ids travel from the pipeline through the loop)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.data import indexed, pipeline  # pylint: disable=import-outside-toplevel

  prefix = str(tmp_path / 'corpus_text_document')
  rng = np.random.default_rng(0)
  with indexed.IndexedDatasetWriter(prefix) as writer:
    for _ in range(200):  # eod = 2 in the smoke config
      writer.add_document(np.append(rng.integers(1000, 1100, size=rng.integers(5, 30)), 2))
  repo = os.path.join(os.path.dirname(__file__), '..', '..')
  argv = [
    'train',
    f'--config={repo}/configs/pretrain_1p7b.py:smoke',
    '--config.data.source=megatron',
    f'--config.data.train_prefixes={prefix}',
    '--config.data.packing=True',
    f'--config.data.cache_dir={tmp_path}/cache',
    f'--config.output_dir={tmp_path}/run',
    '--config.model.seq_len=32',
    '--config.model.num_layers=2',
    '--config.train.steps=2',
    '--config.train.warmup_steps=0',
    '--config.train.wsd_decay_steps=1',
    '--config.log.every=1',
  ]
  config, rest = config_lib.parse_command_line(argv, 'configs/tiny.py')
  assert rest == ['train']
  batch = next(pipeline.make_batch_iterator(config))
  tokens = batch['tokens']
  assert ((tokens == 2) | ((tokens >= 1000) & (tokens < 1100))).all()
  assert (batch['segment_ids'][:, -1] > 1).any()
  row = loop.train(config)
  assert row['step'] == 2 and np.isfinite(row['loss'])
  assert sorted(_losses(config.output_dir)) == [1, 2]


def test_consecutive_non_finite_steps_stop_with_a_good_checkpoint(tmp_path, monkeypatch):
  import dataclasses  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax.train import stages  # pylint: disable=import-outside-toplevel

  pretrain = stages.BUILDERS['pretrain']

  def faulty(config):
    stage = pretrain(config)
    return dataclasses.replace(stage, loss=faults.nan_on([2, 3, 4, 5, 6, 7], stage.loss))

  monkeypatch.setitem(stages.BUILDERS, 'pretrain', faulty)
  c = _config(tmp_path, **{'train.max_consecutive_skips': 2, 'checkpoint.every': 0})
  with pytest.raises(loop.NonFiniteError, match='2 consecutive steps'):
    loop.train(c)
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, 'metrics.jsonl'))]
  # The loss sees the 0-based step of the state: injected 2, 3 are logged steps 3 and 4.
  assert [r['skipped'] for r in rows] == [0.0, 0.0, 1.0, 1.0]
  assert rows[-1]['skipped_total'] == 2
  # The saved state is the last good one: finite params, as step 2 left them.
  _, step_dir, step = run_dir_lib.resolve_step_dir(str(tmp_path))
  params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(c))
  assert step >= 3
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_a_divergence_keeps_the_last_good_checkpoint_and_rolls_back(tmp_path, monkeypatch, capsys):
  """Steps 6 and 7 diverge (non-finite): checkpoint 4, the newest a healthy loss vouched for
  (step 5's loss ran on its params), stays out of rotation, and with rollback_on_divergence the
  run restores it at step 7 and trains on at step 8 (the batches of 5-7 skipped)."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import stages  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel

  pretrain = stages.BUILDERS['pretrain']

  def faulty(config):
    stage = pretrain(config)
    return dataclasses.replace(stage, loss=faults.nan_on([5, 6], stage.loss))  # logged steps 6, 7

  monkeypatch.setitem(stages.BUILDERS, 'pretrain', faulty)
  overrides = {
    'train.steps': 10,
    'checkpoint.every': 1,
    'checkpoint.keep': 3,
    'train.rollback_on_divergence': True,
  }
  c = _config(tmp_path, **overrides)
  loop.train(c)
  (line,) = [x for x in capsys.readouterr().out.splitlines() if 'diverged' in x]
  assert line.startswith('step 6 diverged: the loss nan or the gradient is not finite; ')
  assert (
    f'rolled back to {tmp_path}/checkpoints/4 (kept out of rotation), skipping the data of ' in line
  )
  assert 'steps 5-7: training goes on at step 8.' in line
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['10', '4', '8', '9', 'pinned.json']
  # The final state descends from checkpoint 4: Adam counted updates 1-4 and 8-10 (7), where
  # training on from the skipped steps would count 1-5 and 8-10 (8).
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
  checkpoints = checkpoint_lib.RunCheckpoints(str(tmp_path), read_only=True)
  state, data_state = checkpoints.restore(10, setup)
  checkpoints.close()
  counts = {
    int(v)
    for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state['opt_state']))[0]
    if 'count' in jax.tree_util.keystr(path)
  }
  assert counts == {7}, counts
  assert data_state['consumed_samples'] == 10 * 16  # the data position went on past the window


def _rows(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [row for row in map(json.loads, f) if 'loss' in row]


@pytest.mark.slow  # ~50 s on 2 cores: two more meshes compile
def test_resume_is_exact_and_continues_on_other_meshes(straight_run, tmp_path):
  """Stopped at step 4 (between saves), resumed on the same mesh (fsdp 8) to step 10: the losses
  are the straight run's exactly. Then fsdp 4 x tensor 2 -> pipeline 2 x fsdp 4: every restore is
  the saved state bit for bit (its checksums are verified, and they do not depend on the mesh);
  the losses then follow the straight run's up to the reduction order of the other layouts."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  loop.train(_config(tmp_path, **{'train.exit_at_step': 4}))
  assert max(_losses(tmp_path)) == 4
  loop.train(_config(tmp_path, **{'train.exit_at_step': 10}))  # resumes from step 4
  loop.train(_config(tmp_path, **{'train.exit_at_step': 16, 'mesh.fsdp': 4, 'mesh.tensor': 2}))
  loop.train(_config(tmp_path, **{'mesh.pipeline': 2, 'mesh.fsdp': 4}))
  resumed, expected = _losses(tmp_path), _losses(straight_run)
  assert [r['step'] for r in _rows(tmp_path)] == list(range(1, 21))  # no row twice
  assert [resumed[s] for s in range(1, 11)] == [expected[s] for s in range(1, 11)]
  np.testing.assert_allclose(
    [resumed[s] for s in range(11, 21)], [expected[s] for s in range(11, 21)], rtol=2e-5
  )


def test_a_second_run_on_one_directory_is_refused_naming_the_first(tmp_path):
  import socket  # pylint: disable=import-outside-toplevel

  from dlmjax.train import run_lock  # pylint: disable=import-outside-toplevel

  with run_lock.RunLock(str(tmp_path)):
    with pytest.raises(run_lock.RunDirectoryInUse) as e:
      loop.train(_config(tmp_path))
  message = str(e.value)
  assert f'pid {os.getpid()} on host {socket.gethostname()}' in message, message
  assert f'delete {tmp_path}/.lock' in message and '\n' not in message
  assert not os.path.exists(tmp_path / 'checkpoints')
  with run_lock.RunLock(str(tmp_path)):  # released: the next run takes it
    pass


def test_max_minutes_stops_with_a_checkpoint_and_keep_every_keeps_milestones(tmp_path, capsys):
  c = _config(
    tmp_path,
    **{'train.max_minutes': 1e-6, 'checkpoint.every': 2, 'checkpoint.keep': 1},
  )
  loop.train(c)
  lines = capsys.readouterr().out.splitlines()
  stop = lines.index(next(x for x in lines if 'checkpointing step 1 and stopping' in x))
  assert lines[stop].startswith('train.max_minutes=1e-06: checkpointing step 1 and stopping')
  step_line = next(i for i, x in enumerate(lines) if x.startswith('step 1') and 'loss' in x)
  assert step_line < stop  # the step's own line, then the one saying training stops after it
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1']
  c = _config(
    tmp_path,
    **{'train.steps': 12, 'checkpoint.every': 2, 'checkpoint.keep': 1, 'checkpoint.keep_every': 4},
  )
  loop.train(c)
  assert sorted(os.listdir(tmp_path / 'checkpoints'), key=int) == ['4', '8', '12']
  assert [r['step'] for r in _rows(tmp_path)] == list(range(1, 13))


def test_every_minutes_saves_when_the_time_has_come(monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(loop.time, 'time', lambda: now[0])
  clock = loop._Clock(  # pylint: disable=protected-access
    config_lib.apply_overrides(
      config_lib.defaults(), ['checkpoint.every_minutes=2', 'train.max_minutes=10']
    )
  )
  clock.tick(first=True)
  now[0] += 30
  clock.tick(first=False)  # a 30 s step
  assert not clock.save_due() and not clock.stop_due(slowest_save_s=5)
  now[0] += 90
  assert clock.save_due()
  # 10 min: stop when two 30 s steps and a 5 s save no longer fit.
  now[0] = 1000.0 + 600 - 65
  assert clock.stop_due(slowest_save_s=5)
  now[0] -= 1
  assert not clock.stop_due(slowest_save_s=5)
