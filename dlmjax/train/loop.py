"""The training loop every stage runs: setup -> state -> data -> step -> loop -> finish."""

from __future__ import annotations

import os
import time

import jax

from dlmjax import config as config_lib
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import reporting, stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib


class NonFiniteError(RuntimeError):
  """Too many consecutive steps had a non-finite loss or gradient."""


def check_output_dir(output_dir: str) -> None:
  """Fails before any work when the run directory cannot be written."""
  try:
    os.makedirs(output_dir, exist_ok=True)
    probe = os.path.join(output_dir, f'.write_test_{jax.process_index()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise config_lib.ConfigError(f'output_dir {output_dir!r} is not writable ({e.strerror}); set '
                                 '--config.output_dir to a writable directory.') from e


def initial_state(config, setup, checkpoints):
  """The resume order, written once: this run's latest checkpoint -> init_from -> scratch."""
  latest = checkpoints.latest_step()
  if latest is not None:
    saved = checkpoint_lib.load_run_config(config.output_dir)
    checkpoint_lib.check_resumable(saved, config)
    print(f'resuming from {checkpoints.directory}/{latest}', flush=True)
    return checkpoints.restore(latest, setup)
  if config.init_from:
    run_dir, step_dir, _ = checkpoint_lib.resolve_step_dir(config.init_from)
    checkpoint_lib.check_architecture(checkpoint_lib.load_run_config(run_dir), config)
    print(f'initialising from {step_dir}', flush=True)
    params = checkpoint_lib.restore_params(step_dir, config, setup.mesh)
    return setup.state_from_params(params), None
  return setup.init_state(config.seed), None


def _last_step(config) -> int:
  exit_at = config.train.exit_at_step
  return min(exit_at, config.train.steps) if exit_at > 0 else config.train.steps


def _should_save(config, step: int) -> bool:
  every = config.checkpoint.every
  return step == _last_step(config) or (every > 0 and step % every == 0)


def train(config) -> dict | None:
  """Runs config.stage to config.train.steps; returns the last logged metrics row."""
  # Setup.
  check_output_dir(config.output_dir)
  mesh = mesh_lib.make_mesh(config)  # validates config, resolves a -1 mesh axis
  setup = state_lib.TrainSetup(config, mesh)
  stage = stages.STAGES[config.stage]
  checkpoints = checkpoint_lib.RunCheckpoints(config.output_dir, keep=config.checkpoint.keep,
                                              async_save=config.checkpoint.async_save)
  if jax.process_index() == 0:
    m = config.mesh
    print(f'{config.stage}: {setup.model_config.num_params():,} parameters on '
          f'{jax.device_count()} x {jax.devices()[0].device_kind} (data {m.data} x fsdp {m.fsdp} '
          f'x tensor {m.tensor}); run directory {config.output_dir}', flush=True)
  # State.
  state, data_state = initial_state(config, setup, checkpoints)
  checkpoint_lib.write_run_config(config.output_dir, config)
  start = int(jax.device_get(state['step']))
  # Data.
  batches = stage.batch_iterator(config, process_index=jax.process_index(),
                                 process_count=jax.process_count())
  if data_state is not None:
    batches.set_state(data_state)
  # Step.
  step_fn = step_lib.CompiledStep(setup, stage.loss_fn(config))
  reporter = reporting.Reporter(config.output_dir, total_steps=config.train.steps,
                                flops_per_token=setup.model_config.flops_per_token(),
                                peak_tflops=config.log.peak_tflops)
  # Loop: dispatch step n, then read back step n-1's metrics, so the device never waits on us.
  pending, last_row = None, None
  reporter.start(start)
  compile_start = time.time()
  for step in range(start + 1, _last_step(config) + 1):
    local = next(batches)
    batch = {k: jax.make_array_from_process_local_data(step_fn.batch_sharding, v)
             for k, v in local.items()}
    state, metrics = step_fn(state, batch)
    if pending is not None:
      last_row = _report(reporter, config, *pending) or last_row
      _stop_if_diverged(config, reporter, checkpoints, state, batches)
    elif step == start + 1:
      jax.block_until_ready(metrics)
      print(f'compiled and ran the first step in {time.time() - compile_start:.1f}s', flush=True)
      reporter.start(start)
    pending = (step, metrics)
    if _should_save(config, step):
      checkpoints.save(state, batches.get_state())
  # Finish.
  if pending is not None:
    last_row = _report(reporter, config, *pending) or last_row
    _stop_if_diverged(config, reporter, checkpoints, state, batches)
  checkpoints.close()
  return last_row


def _report(reporter, config, step, metrics):
  write = step % config.log.every == 0 or step == _last_step(config)
  return reporter.record(step, metrics, write=write)


def _stop_if_diverged(config, reporter, checkpoints, state, batches) -> None:
  """After max_consecutive_skips skipped updates: checkpoint the last good state, then stop.

  Skipped steps leave params and optimizer untouched, so `state` holds the last good weights.
  """
  limit = config.train.max_consecutive_skips
  if limit <= 0 or reporter.consecutive_skips < limit:
    return
  checkpoints.save(state, batches.get_state())
  checkpoints.close()
  raise NonFiniteError(
      f'{reporter.consecutive_skips} consecutive steps had a non-finite loss or gradient '
      f'(skipped {reporter.skipped_total} in all); the last good state is saved in '
      f'{checkpoints.directory}. Lower --config.train.lr, check the data, or raise '
      '--config.train.max_consecutive_skips.')
