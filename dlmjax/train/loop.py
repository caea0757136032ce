"""The training loop every stage runs: setup -> state -> data -> step -> loop -> finish."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time

import jax

from dlmjax import config as config_lib
from dlmjax.checkpoint import compatibility
from dlmjax.checkpoint import init_from as init_from_lib
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import peft_io
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import run_model
from dlmjax.observability import history, plots
from dlmjax.observability import sinks as sinks_lib
from dlmjax.parallel import distributed
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import data_fingerprint, divergence, guards, lora_setup, memory, preemption
from dlmjax.train import reporting
from dlmjax.train import run_lock, stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib


class NonFiniteError(config_lib.UserError, RuntimeError):
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
    raise config_lib.ConfigError(
      f'output_dir {output_dir!r} is not writable ({e.strerror}); set '
      '--config.output_dir to a writable directory.'
    ) from e


def initial_state(config, setup, checkpoints):
  """The resume order, written once: this run's latest checkpoint -> init_from -> scratch.

  A LoRA run first restores its frozen base from init_from (on resume too), and its state is
  the adapters: from train.lora.init_adapter, or fresh.
  """
  checkpoints.refuse_if_only_set_aside()
  resuming = checkpoints.latest_step() is not None
  if setup.lora:
    setup.set_base(run_model.source_params(config, setup.mesh, purpose='LoRA base'))
    lora_setup.record_or_check_base(
      config.output_dir, config.init_from, setup.frozen, resuming=resuming
    )
  if resuming:
    saved = run_dir_lib.load_run_config(config.output_dir)
    compatibility.check_resumable(saved, config)
    lora_setup.check_resumable(saved, config)
    return checkpoints.restore_latest(setup)  # skips corrupt steps, with a warning
  if setup.lora:
    if config.train.lora.init_adapter:
      adapters = peft_io.read_adapter(config.train.lora.init_adapter, config, setup)
    else:
      adapters = lora_setup.init_adapters(
        setup.trainable_shapes, config.seed, setup.model_config.init_std
      )
    return setup.state_from_params(adapters), None
  if config.init_from:  # a run/step or Hugging Face directory (init_from.py)
    return setup.state_from_params(
      run_model.source_params(config, setup.mesh, purpose='initialising')
    ), None
  return setup.init_state(config.seed), None


def _last_step(config) -> int:
  exit_at = config.train.exit_at_step
  return min(exit_at, config.train.steps) if exit_at > 0 else config.train.steps


def _should_evaluate(config, step: int) -> bool:
  return step % config.eval.every == 0 or step == _last_step(config)


def _should_save(config, step: int) -> bool:
  every = config.checkpoint.every
  return step == _last_step(config) or (every > 0 and step % every == 0)


def train(config) -> dict | None:
  """Runs the config's stage to config.train.steps; returns the last logged metrics row.

  SIGTERM/SIGINT end the run early, after a checkpoint of the step in flight (preemption).
  """
  guards.check_inputs(config)  # missing data or tokenizer: one line, before any directory or model
  created = not os.path.exists(config.output_dir)
  try:
    # On any error, saves already started (of good states) still finish before it propagates.
    with (
      contextlib.ExitStack() as cleanup,
      preemption.StopRequest() as stop,
      guards.explain_out_of_memory(),
    ):
      if stop.signal_name is not None:  # came while the program started: nothing to save yet
        print(
          f'{stop.signal_name} before training started: stopping, nothing to checkpoint; the '
          'same command starts the run.',
          flush=True,
        )
        return None
      return _run(config, stop, cleanup)
  except BaseException:
    if created:
      _remove_if_unused(config.output_dir)
    raise


def _remove_if_unused(output_dir: str) -> None:
  """A start that failed before its first metrics row or checkpoint leaves no run directory
  behind (it would hold only the config and an empty log)."""
  checkpoints = os.path.join(output_dir, run_dir_lib.CHECKPOINT_DIR)
  used = os.path.exists(os.path.join(output_dir, 'metrics.jsonl')) or (
    os.path.isdir(checkpoints) and os.listdir(checkpoints)
  )
  if jax.process_index() == 0 and not used:
    shutil.rmtree(output_dir, ignore_errors=True)


class _Clock:
  """The time-based knobs: checkpoint.every_minutes and train.max_minutes (a job's time limit).

  The stop comes early enough for two more of the slowest steps seen and the slowest save seen
  (blocked time plus background write), so the final checkpoint is complete before the limit.
  """

  def __init__(self, config):
    self.started = self.last_save = self._last_tick = time.time()
    self.save_every_s = config.checkpoint.every_minutes * 60
    self.limit_s = config.train.max_minutes * 60
    self.slowest_step_s = 0.0

  def tick(self, first: bool) -> None:
    now = time.time()
    if not first:  # the first step compiles
      self.slowest_step_s = max(self.slowest_step_s, now - self._last_tick)
    self._last_tick = now

  def save_due(self) -> bool:
    return self.save_every_s > 0 and time.time() - self.last_save >= self.save_every_s

  def stop_due(self, slowest_save_s: float) -> bool:
    if self.limit_s <= 0:
      return False
    return time.time() - self.started + 2 * self.slowest_step_s + slowest_save_s >= self.limit_s


def _run(config, stop, cleanup) -> dict | None:
  # Setup.
  clock = _Clock(config)
  check_output_dir(config.output_dir)
  schedule_note = config_lib.fit_schedule(config)
  sinks_lib.check_installed(config)
  if schedule_note and jax.process_index() == 0:
    print(schedule_note, flush=True)
  cleanup.enter_context(run_lock.RunLock(config.output_dir))  # one run per directory
  if config.init_from:  # model keys left at their defaults come from the source model
    adopted = init_from_lib.adopt_source_config(config)
    if adopted and jax.process_index() == 0:
      print(f'from init_from {config.init_from}: {", ".join(adopted)}', flush=True)
  mesh = mesh_lib.make_mesh(config)  # validates config, resolves a -1 mesh axis
  if config.train.check_memory:  # fail in seconds, not after compiling or at the first OOM
    memory.check_fits(config, memory.present_device_memory_bytes())
  stage = stages.build(config)
  setup = state_lib.TrainSetup(config, mesh, stage)
  # Before the checkpoint manager starts its threads: a refusal here leaves nothing running.
  disk = guards.check_free_disk(
    config.output_dir, setup.state_shapes, guards.checkpoints_on_disk(config)
  )
  if jax.process_index() == 0:
    print(disk, flush=True)
  checkpoints = checkpoint_lib.RunCheckpoints(
    config.output_dir, keep=config.checkpoint.keep, keep_every=config.checkpoint.keep_every
  )
  cleanup.callback(checkpoints.close)
  if jax.process_index() == 0:
    m = config.mesh
    print(
      f'{stage.name}: {_parameter_count(setup)} on '
      f'{jax.device_count()} x {jax.devices()[0].device_kind} (data {m.data} x fsdp {m.fsdp} '
      f'x tensor {m.tensor}); run directory {config.output_dir}',
      flush=True,
    )
  # State.
  state, data_state = initial_state(config, setup, checkpoints)
  checkpoints.warm_up(state)  # the save's checksums compile beside the train step
  params_checkpoint.write_run_config(config.output_dir, config)
  start = int(jax.device_get(state['step']))
  if start >= _last_step(config):  # a finished run: say so, and how to go on, not silently exit
    if jax.process_index() == 0:
      print(_already_finished(config, start), flush=True)
    return None
  if jax.process_index() == 0:  # rows the killed run logged past its last checkpoint
    history.drop_rows_after(config.output_dir, start)
  # Step.
  step_fn = step_lib.CompiledStep(setup, stage)
  # Data: each process reads the rows its devices hold in the step's batch layout.
  shard, shards = distributed.data_shard(step_fn.batch_sharding, config.train.global_batch_size)
  batches = stage.batches(setup, shard, shards)
  dataset = data_fingerprint.fingerprint(config, stage.data_keys)
  position = data_fingerprint.position_to_resume(data_state, dataset, config)
  if position is not None:
    batches.set_state(position)
  reporter = reporting.Reporter(
    config.output_dir,
    total_steps=config.train.steps,
    flops_per_token=setup.model_config.flops_per_token(config_lib.attention_streams(config)),
    peak_tflops=0.0,
    sinks=sinks_lib.make_sinks(config, config.output_dir),
    console_metrics=stage.console_metrics,
    flag_spikes=stage.flag_spikes,
  )
  cleanup.callback(reporter.close)
  watch = divergence.DivergenceWatch(
    config.train.spike_factor, config.train.spike_window, check_spikes=stage.flag_spikes
  )
  evaluator = stage.evaluator(setup) if config.eval.every else None
  # Loop: dispatch step n, then read back step n-1's metrics, so the device never waits on us.
  pending, last_row, saved_step, reported_last = None, None, None, False
  reporter.start(start)
  compile_start = time.time()
  if jax.process_index() == 0 and start < _last_step(config):
    print(f'step {start + 1}: first batch, then compiling the train step...', flush=True)
  for step in range(start + 1, _last_step(config) + 2):
    # The data position after the step dispatched last (a save's), then the next batch.
    position = data_fingerprint.stamp(batches.get_state(), dataset)
    if step <= _last_step(config):
      # The params of the step about to run (RL samples its rollouts from them).
      if stage.carried is not None:  # e.g. RL's refreshed KL reference scores the next rollout
        stage.carried.hand_over(batches, state[stage.carried.key])
      try:
        local, row = guards.next_batch(batches, setup.model_params(state['params']), config, step)
      except BaseException:
        if step - 1 > start and _should_save(config, step - 1):  # a good state, due anyway
          checkpoints.save(state, position)
        raise
      if row is not None:
        reporter.write_row(row)
      batch = {
        k: jax.make_array_from_process_local_data(step_fn.batch_sharding, v)
        for k, v in local.items()
      }
    # Decisions for the step dispatched last, taken just before the next is: a stop saves the
    # step in flight when the signal came (reading a batch included), never one after it.
    done = step - 1
    if done > start:
      clock.tick(first=done == start + 1)
      preempted, timed_save, out_of_time = preemption.any_process(
        [stop.signal_name is not None, clock.save_due(), clock.stop_due(checkpoints.slowest_save_s)]
      )
      if preempted or out_of_time or timed_save or _should_save(config, done):
        checkpoints.save(state, position)
        saved_step = done
        clock.last_save = time.time()
        # The step's row says how long its save held training up (docs/benchmarks.md,
        # Checkpoints).
        pending = (done, dict(pending[1], checkpoint_blocked_s=checkpoints.last_blocked_s))
      if (preempted or (out_of_time and done < _last_step(config))) and pending is not None:
        # The step's own line first, then the line saying training stops after it.
        last_row = _report(reporter, config, *pending, start) or last_row
        reported_last = True
      if preempted:
        received = stop.signal_name or 'a stop signal on another process'
        print(
          f'{received}: checkpointing step {done} and stopping; the same command resumes from it.',
          flush=True,
        )
        break
      if out_of_time and done < _last_step(config):
        left = clock.limit_s - (time.time() - clock.started)
        print(
          f'train.max_minutes={config.train.max_minutes:g}: checkpointing step {done} and '
          f'stopping {left:.0f}s before the limit; the same command resumes from it.',
          flush=True,
        )
        break
    if step > _last_step(config):
      break
    if step == start + 1 and jax.process_count() > 1:
      # Compile, then line the processes up: a collective times out (gloo's after 30 s) while
      # another process is still compiling. The call below reuses the compiled step.
      step_fn.compile(state, batch)
      distributed.barrier('first_step_compiled')
    state, metrics = step_fn(state, batch)
    reporter.watch(step, metrics)
    if pending is not None:
      last_row = _report(reporter, config, *pending, start) or last_row
      state = _watch_divergence(config, watch, reporter, checkpoints, setup, state, step)
      _stop_if_diverged(config, reporter, checkpoints, state, batches, dataset)
    elif step == start + 1:
      jax.block_until_ready(metrics)
      if jax.process_index() == 0:
        print(f'compiled and ran the first step in {time.time() - compile_start:.1f}s', flush=True)
      reporter.start(step)  # throughput and ETA from here: compilation is not a step's time
    pending = (step, metrics)
    if evaluator is not None and _should_evaluate(config, step):
      reporter.write_row(
        evaluator.run(step, setup.model_params(state['params']))
      )  # val_loss / val_reward, ...
  # Finish.
  if pending is not None:
    if not reported_last:
      last_row = _report(reporter, config, *pending, start) or last_row
    _watch_divergence(config, watch, reporter, checkpoints, setup, state, None)
    _stop_if_diverged(config, reporter, checkpoints, state, batches, dataset)
  checkpoints.close()
  reporter.close()
  _draw_plots(config)
  if jax.process_index() == 0 and pending is not None:
    summary = reporter.summary(
      pending[0],
      run_dir=config.output_dir,
      saved_step=saved_step,
      outputs=config_lib.log_outputs(config),
    )
    print(summary, flush=True)
  return last_row


def _parameter_count(setup) -> str:
  """The start line's count: the model's parameters, and for LoRA the adapters it trains."""
  total = f'{setup.model_config.num_params():,} parameters'
  if not setup.lora:
    return total
  trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(setup.trainable_shapes))
  return f'{trainable:,} trainable adapter parameters (LoRA) over a frozen base of {total}'


def _already_finished(config, step: int) -> str:
  return (
    f'{config.output_dir} is already at step {step} of {config.train.steps}: nothing to train. '
    f'To continue it, raise --config.train.steps (e.g. --config.train.steps={2 * step}); to '
    'start anew, give a new --config.output_dir.'
  )


def _draw_plots(config) -> None:
  if 'plots' not in config_lib.log_outputs(config) or jax.process_index() != 0:
    return
  try:
    plots.draw(config.output_dir)
  except plots.PlotError as e:
    print(f'no plots: {e}', flush=True)


def _report(reporter, config, step, metrics, start):
  """Records a step; rows are written every log.every steps, for the run's first step (where
  the loss starts) and for its last."""
  write = step % config.log.every == 0 or step in (start + 1, _last_step(config))
  return reporter.record(step, metrics, write=write)


def _watch_divergence(config, watch, reporter, checkpoints, setup, state, step_now):
  """On the first step of a divergence: keeps the last good checkpoint out of rotation and,
  with train.rollback_on_divergence (and a step still to run: step_now), restores it; the step
  counter and the data position stay at step_now, so the batches since it are skipped.
  Returns the state to train on."""
  step, metrics = reporter.latest
  reason = watch.observe(step, metrics['loss'], bool(metrics['skipped']))
  if reason is None:
    return state
  checkpoints.wait()
  good = divergence.last_good_step(checkpoints.all_steps(), step)
  head = f'step {step} diverged: {reason}'
  if good is None:
    _say(f'{head}; no checkpoint before it is known to be good (none kept out of rotation).')
    return state
  checkpoints.pin(good)
  kept = f'{checkpoints.directory}/{good}'
  if not config.train.rollback_on_divergence or step_now is None:
    _say(
      f'{head}; {kept} is kept out of rotation as the last good checkpoint '
      '(--config.train.rollback_on_divergence=True rolls back to it and skips the data since).'
    )
    return state
  restored, _ = checkpoints.restore(good, setup)
  watch.forget(step_now)  # step_now ran on the diverged state too
  reporter.consecutive_skips = 0
  _say(
    f'{head}; rolled back to {kept} (kept out of rotation), skipping the data of steps '
    f'{good + 1}-{step_now}: training goes on at step {step_now + 1}.'
  )
  return dict(restored, step=state['step'])


def _say(line: str) -> None:
  if jax.process_index() == 0:
    print(line, flush=True)


def _stop_if_diverged(config, reporter, checkpoints, state, batches, dataset) -> None:
  """After max_consecutive_skips skipped updates: checkpoint the last good state, then stop.

  Skipped steps leave params and optimizer untouched, so `state` holds the last good weights.
  """
  limit = config.train.max_consecutive_skips
  if limit <= 0 or reporter.consecutive_skips < limit:
    return
  checkpoints.save(state, data_fingerprint.stamp(batches.get_state(), dataset))
  checkpoints.close()
  raise NonFiniteError(
    f'{reporter.consecutive_skips} consecutive steps had a non-finite loss or gradient '
    f'(skipped {reporter.skipped_total} in all); the last good state is saved in '
    f'{checkpoints.directory}. Lower --config.train.lr, check the data, or raise '
    '--config.train.max_consecutive_skips.'
  )
