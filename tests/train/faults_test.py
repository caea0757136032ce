"""Real faults on real training subprocesses: SIGTERM, kill -9 in the middle of a save and at a
seeded random step, a corrupt latest checkpoint, a second run on the same directory and a full
disk; each resume must reproduce the uninterrupted run's losses exactly and log no row twice.

One chain of runs shares one persistent compilation cache (only the first run compiles):
  A  uninterrupted, 18 steps
  B  SIGTERM while step 1 compiles -> checkpoint 1, exit 0
  C  resumes B; saves 6; its save of 12 stalls (test hook) and is killed with SIGKILL; while it
     stalls, a second run on the same directory is refused (the lock)
  E  after checkpoint 6 is corrupted on disk: skips it with a warning, resumes from 1, finishes
  K  a fresh run killed with SIGKILL at a seeded random step, then resumed to the end
  F  a run whose save of step 12 fails as on a full disk: one error line, checkpoint 6 intact
"""

import json
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from dlmjax.observability import sinks, tensorboard
from tests.conftest import FAST_COMPILE

# ~35 s on 2 cores (one chain of 4 training subprocesses), more on a busy machine.
pytestmark = pytest.mark.slow

REPO = os.path.join(os.path.dirname(__file__), '..', '..')
STEPS = 18
OVERRIDES = {
  'model.num_layers': 1,
  'model.d_model': 64,
  'model.num_heads': 4,
  'model.num_kv_heads': 2,
  'model.head_dim': 16,
  'model.ffn_dim': 128,
  'model.seq_len': 32,
  'train.global_batch_size': 16,
  'train.micro_batch_size': 16,
  'train.warmup_steps': 2,
  'train.wsd_decay_steps': 2,
  'train.steps': STEPS,
  'checkpoint.every': 6,
  'checkpoint.keep': 3,
  'log.every': 1,
  'log.outputs': 'tensorboard',
}


def _command(run_dir):
  flags = [f'--config.{k}={v}' for k, v in OVERRIDES.items()]
  cache = os.environ.get('DLMJAX_CACHE_DIR')
  if cache:
    flags.append(f'--config.data.cache_dir={cache}')
  return [
    sys.executable,
    '-u',
    '-m',
    'dlmjax.train',
    f'--config={REPO}/configs/tiny.py',
    f'--config.output_dir={run_dir}',
    *flags,
  ]


def _env(compile_cache, **extra):
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    XLA_FLAGS=' '.join([*FAST_COMPILE, '--xla_force_host_platform_device_count=1']),
    JAX_COMPILATION_CACHE_DIR=str(compile_cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
    **extra,
  )
  env['PYTHONPATH'] = os.path.abspath(REPO)
  return env


def _run_until(run_dir, env, marker, action):
  """Starts a run, applies `action(proc)` at the first output line containing `marker`;
  returns (exit code, output)."""
  proc = subprocess.Popen(
    _command(run_dir),
    env=env,
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if marker in line:
      action(proc)
      break
  rest, _ = proc.communicate(timeout=300)
  return proc.returncode, ''.join(lines) + rest


def _losses(run_dir):
  """{step: loss}; a step logged twice (before and after a resume) keeps its last value."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return {row['step']: row['loss'] for row in map(json.loads, f) if 'loss' in row}


def _logged_steps(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [row['step'] for row in map(json.loads, f) if 'loss' in row]


def _committed(run_dir):
  return sorted(int(n) for n in os.listdir(os.path.join(run_dir, 'checkpoints')) if n.isdigit())


def _corrupt_params(step_dir):
  """Overwrites bytes in the middle of the largest file of the params item (bit rot)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, 'params')) for f in fs]
  target = max(files, key=os.path.getsize)
  with open(target, 'r+b') as f:
    size = os.path.getsize(target)
    f.seek(size // 2)
    chunk = bytearray(f.read(min(512, size - size // 2)))
    f.seek(size // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))


@pytest.fixture(scope='module')
def chain(tmp_path_factory):
  root = tmp_path_factory.mktemp('faults')
  cache = root / 'compile_cache'
  out = types.SimpleNamespace(straight=root / 'straight', run=root / 'run')
  done = subprocess.run(
    _command(out.straight), env=_env(cache), cwd=REPO, capture_output=True, text=True, timeout=600
  )
  assert done.returncode == 0, done.stdout + done.stderr
  # B: the handler is in place before the banner line, so SIGTERM lands while step 1 compiles.
  out.b_code, out.b_output = _run_until(
    out.run, _env(cache), 'parameters on', lambda p: p.send_signal(signal.SIGTERM)
  )
  out.b_checkpoints = _committed(out.run)
  out.b_losses = _losses(out.run)
  # C: stalls inside the commit of checkpoint 12 (its files written); killed right there.
  stall = _env(cache, **{checkpoint_lib.COMMIT_DELAY_ENV: '12:120'})

  def second_run_then_kill(proc):
    second = subprocess.run(
      _command(out.run), env=_env(cache), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    out.second = (second.returncode, second.stdout + second.stderr, proc.pid)
    proc.kill()

  out.c_code, out.c_output = _run_until(
    out.run, stall, 'stalling the commit of checkpoint 12', second_run_then_kill
  )
  out.c_entries = sorted(os.listdir(out.run / 'checkpoints'))
  out.c_losses = _losses(out.run)
  out.after_kill = run_dir_lib.resolve_step_dir(str(out.run))
  _corrupt_params(str(out.run / 'checkpoints' / '6'))
  done = subprocess.run(
    _command(out.run), env=_env(cache), cwd=REPO, capture_output=True, text=True, timeout=600
  )
  out.e_code, out.e_output = done.returncode, done.stdout + done.stderr
  # K: SIGKILL when a seeded random step is logged, then the same command to the end.
  out.kill_step = int(np.random.default_rng(25).integers(2, STEPS))
  out.k = root / 'killed'
  out.k_code, _ = _run_until(
    out.k, _env(cache), f'step {out.kill_step}/{STEPS}', lambda p: p.kill()
  )
  done = subprocess.run(
    _command(out.k), env=_env(cache), cwd=REPO, capture_output=True, text=True, timeout=600
  )
  out.k_resume = (done.returncode, done.stdout + done.stderr)
  # F: the save of step 12 runs out of space (DISK_FULL_ENV fails it as ENOSPC does).
  out.f = root / 'full'
  done = subprocess.run(
    _command(out.f),
    env=_env(cache, **{checkpoint_lib.DISK_FULL_ENV: '12'}),
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  out.f_code, out.f_stderr = done.returncode, done.stderr
  return out


def test_sigterm_checkpoints_the_step_in_flight_and_exits_0(chain):
  assert chain.b_code == 0, chain.b_output
  assert 'SIGTERM: checkpointing step 1 and stopping' in chain.b_output
  assert chain.b_checkpoints == [1]
  assert chain.b_losses == {1: _losses(chain.straight)[1]}


def test_kill_9_mid_save_leaves_the_previous_checkpoint_usable(chain):
  assert chain.c_code == -signal.SIGKILL, chain.c_output
  assert 'resuming from' in chain.c_output and chain.c_output.count('/checkpoints/1') >= 1
  # Step 12 was being written (a temporary directory) but never committed.
  assert '12' not in chain.c_entries and '6' in chain.c_entries
  assert any(n.startswith('12.') for n in chain.c_entries), chain.c_entries
  run_dir, step_dir, step = chain.after_kill
  assert step == 6
  params = params_checkpoint.restore_params(
    step_dir, *model_lib.param_placement(run_dir_lib.load_run_config(run_dir))
  )
  saved = step_meta.read_meta(step_dir)['checksums']
  assert checksums.compare(saved, checksums.compute(params)) == []
  # The run resumed from SIGTERM's checkpoint reproduced the uninterrupted losses exactly.
  straight = _losses(chain.straight)
  resumed = [s for s in chain.c_losses if s > 1]
  assert len(resumed) >= 10
  assert [chain.c_losses[s] for s in resumed] == [straight[s] for s in resumed]


def test_corrupt_latest_checkpoint_is_skipped_with_a_warning(chain):
  assert chain.e_code == 0, chain.e_output
  warning = [line for line in chain.e_output.splitlines() if line.startswith('warning:')]
  assert warning and f'{chain.run}/checkpoints/6' in warning[0], chain.e_output
  assert f'resuming from {chain.run}/checkpoints/1' in chain.e_output
  assert os.path.isdir(chain.run / 'checkpoints' / '6.corrupt')
  # The temporary directory of the killed save was cleaned up.
  assert not [n for n in os.listdir(chain.run / 'checkpoints') if n.startswith('12.')]
  straight, resumed = _losses(chain.straight), _losses(chain.run)
  assert [resumed[s] for s in range(2, STEPS + 1)] == [straight[s] for s in range(2, STEPS + 1)]
  assert _committed(chain.run) == [6, 12, 18]
  # Rows past the restored step were dropped before the resume: each step logged once, and
  # TensorBoard holds the same rows.
  assert _logged_steps(chain.run) == list(range(1, STEPS + 1))
  log_dir = chain.run / sinks.TENSORBOARD_DIR
  steps = sorted(
    s
    for name in os.listdir(log_dir)
    for s, _ in tensorboard.read_scalars(str(log_dir / name)).get('loss', [])
  )
  assert steps == list(range(1, STEPS + 1))


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first(chain):
  code, output, pid = chain.second
  assert code == 2, output
  errors = [line for line in output.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and f'pid {pid} on host' in errors[0], output
  assert 'Traceback' not in output


def test_kill_9_at_a_random_step_resumes_exactly(chain):
  assert chain.k_code == -signal.SIGKILL
  code, output = chain.k_resume
  assert code == 0, output
  straight, resumed = _losses(chain.straight), _losses(chain.k)
  assert resumed == straight
  assert _logged_steps(chain.k) == list(range(1, STEPS + 1))


def test_a_full_disk_mid_save_ends_in_one_error_line(chain):
  assert chain.f_code == 2, chain.f_stderr
  assert 'Traceback' not in chain.f_stderr, chain.f_stderr
  (error,) = [line for line in chain.f_stderr.splitlines() if line.startswith('error:')]
  for part in (
    f'{chain.f}/checkpoints',
    'checkpoint 12 ran out of space',
    'checkpoint.keep',
    'checkpoint.every',
    'output_dir',
    f'the last complete checkpoint is {chain.f}/checkpoints/6',
  ):
    assert part in error, error
  assert _committed(chain.f) == [6]


def test_tensorboard_scalars_are_written_by_default(chain):
  (name,) = os.listdir(chain.straight / sinks.TENSORBOARD_DIR)
  scalars = tensorboard.read_scalars(str(chain.straight / sinks.TENSORBOARD_DIR / name))
  with open(chain.straight / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  for key in ('loss', 'masked_ce', 'lr', 'grad_norm', 'tokens_per_s'):
    logged = [r for r in rows if key in r]  # the compiling first step has no tokens_per_s
    assert [s for s, _ in scalars[key]] == [r['step'] for r in logged]
    np.testing.assert_array_equal(
      [v for _, v in scalars[key]], np.float32([r[key] for r in logged])
    )
