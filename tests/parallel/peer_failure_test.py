"""A process of a two-process run killed with SIGKILL mid-run: the survivor stops within the
heartbeat timeout with one `error:` line (the dead process, the last complete checkpoint, the
command to resume), no JAX abort dump, and that checkpoint restores intact.

The run is multiprocess_test's (same model, steps and mesh, so a suite run compiles its step
once); it checkpoints steps 2 and 4, and the kill lands while the save of step 4 is in flight
(the commit-delay test hook stalls it), the worst moment: that save must not become a
checkpoint, and step 2 must stay the one to resume from.
"""

import os
import subprocess
import sys
import time

import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from tests.conftest import FAST_COMPILE
from tests.parallel import processes
from tests.parallel.multiprocess_test import OVERRIDES, ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

HEARTBEAT_TIMEOUT_S = 5


def _start(tmp, run_dir, port, process_id):
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in processes.LAUNCH_VARS and not k.startswith('SLURM_')
  }
  env.update(
    PYTHONPATH=ROOT,
    COORDINATOR_ADDRESS=f'localhost:{port}',
    NUM_PROCESSES='2',
    PROCESS_ID=str(process_id),
    HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
    **{checkpoint_lib.COMMIT_DELAY_ENV: '4:300'},
    JAX_PLATFORMS='cpu',
    JAX_NUM_CPU_DEVICES='2',
    XLA_FLAGS=' '.join(FAST_COMPILE),
  )
  overrides = dict(OVERRIDES, **{'checkpoint.every': 2, 'log.outputs': '', 'output_dir': run_dir})
  args = [f'--config.{k}={v}' for k, v in overrides.items()]
  args.append(f'--config.data.cache_dir={processes.cache_dir(tmp)}')
  log = tmp / f'process_{process_id}.log'
  with open(log, 'w') as f:
    proc = subprocess.Popen(
      [sys.executable, '-u', '-m', 'dlmjax.train', '--config=configs/tiny.py', *args],
      cwd=ROOT,
      env=env,
      stdout=f,
      stderr=subprocess.STDOUT,
    )
  return proc, log


def _output(log):
  with open(log) as f:
    return f.read()


def test_a_killed_process_ends_the_other_with_one_line(tmp_path):
  run_dir = str(tmp_path / 'run')
  with processes.reserved_port() as port:
    (survivor, survivor_log), (victim, victim_log) = (
      _start(tmp_path, run_dir, port, i) for i in (0, 1)
    )
    try:
      deadline = time.time() + 500
      while 'stalling the commit of checkpoint 4' not in _output(survivor_log):
        assert survivor.poll() is None and victim.poll() is None, _output(survivor_log)[-3000:]
        assert time.time() < deadline, 'the run never reached the step to kill at'
        time.sleep(0.2)
      victim.kill()
      killed = time.time()
      survivor.wait(timeout=HEARTBEAT_TIMEOUT_S + 60)
      took = time.time() - killed
    finally:
      for proc in (survivor, victim):
        if proc.poll() is None:
          proc.kill()
          proc.wait()
  output = _output(survivor_log)
  assert survivor.returncode != 0, output[-3000:]
  # JAX's coordination service ends the survivor within the heartbeat timeout (plus the start of
  # a busy 2-core machine's watcher), not after its default 100 s.
  assert took < HEARTBEAT_TIMEOUT_S + 25, (took, output[-3000:])
  errors = [line for line in output.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, output[-3000:]
  for noise in ('Traceback', 'Fatal Python error', 'coordination_service', 'Check failure'):
    assert noise not in output, (noise, output[-3000:])
  _, step_dir, step = run_dir_lib.resolve_step_dir(run_dir)
  assert step == 2  # the save of step 4 was in flight: not a checkpoint
  assert errors[0].startswith('error: process 1 of 2 stopped'), errors[0]
  assert f'the last complete checkpoint is step {step} ({step_dir})' in errors[0], errors[0]
  assert 'same command: python -m dlmjax.train --config=configs/tiny.py' in errors[0], errors[0]
  assert f'--config.output_dir={run_dir}' in errors[0], errors[0]
  # That checkpoint is intact: its params restore and match the checksums saved with them.
  saved = run_dir_lib.load_run_config(run_dir)
  params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(saved))
  assert step_meta.read_meta(step_dir)['checksums'] == checksums.compute(params)
