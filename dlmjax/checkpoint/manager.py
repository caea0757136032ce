"""Orbax checkpoints of a training run: save, rotation, and resume with fallback past damage.

A step directory `<run>/checkpoints/<step>/` holds orbax items (step_meta.ITEMS): `params` (the
model), `opt_state` (absent in params-only checkpoints, e.g. imports), RL's `reference` and
`meta` (JSON: step, data iterator state, checksums; checkpoint/step_meta.py). Restores go
straight into the target shardings; nothing is gathered on one host. Params-only readers and
writers are in checkpoint/params_checkpoint.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp

from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import compatibility
from dlmjax.checkpoint import host_transfer
from dlmjax.checkpoint import orbax_noise
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta

# Steps kept out of rotation: the last good checkpoint before a detected divergence.
PINNED_FILE = 'pinned.json'
# Test hook, "STEP:SECONDS": stall the commit of that step's save (its files written, the step not
# yet committed), so a test can kill the process mid-save deterministically.
COMMIT_DELAY_ENV = 'DLMJAX_TEST_COMMIT_DELAY'
# Test hook, "STEP": the save of that step fails as on a full disk (ENOSPC), after writing.
DISK_FULL_ENV = 'DLMJAX_TEST_DISK_FULL'


class DiskFullError(run_dir_lib.CheckpointError):
  """A save ran out of space; the message names the directory, the space and the knobs."""


def _gib(n: int) -> str:
  return f'{n / 2**30:.2f} GiB'


class _Pinned:
  """orbax preservation policy: keeps the steps of a set (shared with RunCheckpoints.pinned)."""

  def __init__(self, steps: set):
    self.steps = steps

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    return [c.step in self.steps for c in checkpoints]


def _read_pins(directory: str) -> set:
  try:
    with open(os.path.join(directory, PINNED_FILE)) as f:
      return set(json.load(f))
  except (OSError, ValueError):
    return set()


class RunCheckpoints:
  """The checkpoints of one run directory.

  A save blocks the caller only while the arrays are checksummed on their devices and copied to
  host memory; orbax writes them in the background. Every item is checksummed (params, optimizer
  state, step and data state); a restore verifies each (docs/faults.md, "Integrity").
  """

  def __init__(
    self,
    run_dir: str,
    *,
    keep: int = 3,
    keep_every: int = 0,
    async_save: bool = True,
    read_only: bool = False,
  ):
    """read_only: for inspection (python -m dlmjax.verify): nothing is created, cleaned up or
    rotated."""
    self.directory = os.path.join(os.path.abspath(run_dir), run_dir_lib.CHECKPOINT_DIR)
    self.keep = keep
    self.pinned = _read_pins(self.directory)
    kept = [
      ocp.checkpoint_managers.LatestN(keep),
      _Pinned(self.pinned),  # the last good checkpoint before a divergence: out of rotation
    ]
    if keep_every:  # milestones: steps divisible by it are never deleted
      kept.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
    options = ocp.CheckpointManagerOptions(
      preservation_policy=None
      if read_only
      else ocp.checkpoint_managers.AnyPreservationPolicy(kept),
      enable_async_checkpointing=async_save,
      create=not read_only,
      read_only=read_only,
      # a save killed mid-write leaves a temporary dir
      cleanup_tmp_directories=not read_only,
      temporary_path_class=_test_hooks(),
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=step_meta.ITEMS
    )
    orbax_noise.quiet_disk_full_tracebacks()
    self._closed = False
    self._in_flight: tuple[int, int] | None = None  # (step, bytes) of the save being written
    self.last_blocked_s = 0.0  # how long the last save() held up the caller
    self._save_started: float | None = None
    self._slowest_save_s = 0.0
    self._failed = False
    self._warm_ups: list[threading.Thread] = []

  def warm_up(self, state: dict) -> None:
    """Compiles the save's checksums and makes its device-to-host copies once for arrays like
    `state`'s in the background, so the first save blocks training no longer than the others
    (docs/benchmarks.md, Checkpoints)."""
    tree = dict(params=state['params'], opt_state=state['opt_state'])
    threads = (checksums.warm_up(tree), host_transfer.warm_up(tree))
    self._warm_ups = [t for t in threads if t is not None]

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def pin(self, step: int) -> None:
    """Keeps `step` out of rotation for good (recorded in checkpoints/pinned.json)."""
    self.pinned.add(step)
    if jax.process_index() == 0:
      tmp = os.path.join(self.directory, PINNED_FILE + '.tmp')
      with open(tmp, 'w') as f:
        json.dump(sorted(self.pinned), f)
      os.replace(tmp, os.path.join(self.directory, PINNED_FILE))

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def refuse_if_only_set_aside(self) -> None:
    """CheckpointError when no checkpoint is left but some were set aside as damaged: the
    same command must not silently start again from step 1 over the run's directory."""
    if self.latest_step() is not None or not os.path.isdir(self.directory):
      return
    aside = sorted(n for n in os.listdir(self.directory) if '.corrupt' in n)
    if aside:
      raise run_dir_lib.CheckpointError(
        f'every checkpoint in {self.directory} was set aside as damaged ({", ".join(aside)}) '
        'and none is usable; nothing was started. To train from scratch over this run, move '
        'the *.corrupt directories away (the metrics of the earlier steps are then dropped); '
        'or start with a new --config.output_dir (--config.init_from a good checkpoint).'
      )

  def restore_latest(self, setup) -> tuple[dict, object]:
    """The newest checkpoint whose bytes read back and match their checksums.

    orbax commits a step atomically (written to a temporary directory, then renamed), so a crash
    mid-save leaves no step behind. A step whose bytes are damaged later (truncated files, bit
    flips, an edited meta item) is renamed to `<step>.corrupt` with one warning naming what
    failed, and the one before it is tried. A step that is intact but does not fit this run
    (other shapes) raises CheckpointError and nothing is renamed or deleted.
    """
    problems = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        state, data_state = self.restore(step, setup)
      except step_meta.DamagedCheckpoint as e:
        problem = f'{self.directory}/{step}: {e}'
        problems.append(problem)
        moved = self._set_aside(step)
        _warn(
          f'checkpoint {problem}; set aside as {moved}, falling back to the previous checkpoint.'
        )
        continue
      if jax.process_index() == 0:
        print(f'resuming from {self.directory}/{step}', flush=True)
      return state, data_state
    raise run_dir_lib.CheckpointError(
      'no usable checkpoint in '
      + self.directory
      + ': '
      + '; '.join(problems)
      + '. Start a new run with a new '
      '--config.output_dir (or --config.init_from a good checkpoint).'
    )

  def _set_aside(self, step: int) -> str:
    """Renames a bad step to `<step>.corrupt[N]` (kept for inspection); returns the new name."""
    src = os.path.join(self.directory, str(step))
    dst, n = src + '.corrupt', 1
    while os.path.exists(dst):
      dst, n = f'{src}.corrupt{n}', n + 1
    if jax.process_index() == 0 and os.path.exists(src):
      os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      multihost_utils.sync_global_devices(f'dlmjax_set_aside_{step}')
    self._manager.reload()
    return os.path.basename(dst)

  def save(self, state: dict, data_state=None) -> None:
    """Starts an async save of the train state and the data iterator's state.

    Checksums of every array are computed on the devices holding each shard (two 32-bit words
    per array reach the host); the caller then waits only for orbax's device-to-host copy.
    """
    # orbax waits for the previous save's background write here anyway; waiting first names the
    # step of a write that failed (a full disk) instead of this one.
    self.wait()
    arrays = {k: v for k, v in state.items() if k != 'step'}  # params, opt_state[, reference]
    jax.block_until_ready(arrays)  # the step itself: not time the save holds training up
    started = time.perf_counter()
    for thread in self._warm_ups:  # a warm-up still running holds this save up: it counts
      thread.join()
    self._warm_ups = []
    step = int(jax.device_get(state['step']))
    digests = checksums.to_hex(checksums.dispatch(arrays))
    meta = dict(
      step=step,
      data_state=data_state,
      checksum_format=checksums.FORMAT,
      checksums={k[len('params/') :]: v for k, v in digests.items() if k.startswith('params/')},
      **{
        f'{item}_checksums': {
          k[len(item) + 1 :]: v for k, v in digests.items() if k.startswith(item + '/')
        }
        for item in arrays
        if item != 'params'
      },
      meta_checksum=step_meta.meta_digest(step, data_state),
      layout=step_meta.layout(arrays),
      format=step_meta.META_FORMAT,
    )
    self._in_flight = (step, sum(x.nbytes for x in jax.tree.leaves(arrays)))
    try:
      self._manager.save(
        step,
        args=ocp.args.Composite(
          **{k: ocp.args.StandardSave(v) for k, v in arrays.items()},
          meta=ocp.args.JsonSave(meta),
        ),
        force=True,
      )
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_disk_full(e)
      raise
    self.last_blocked_s = time.perf_counter() - started
    self._save_started = started

  @property
  def slowest_save_s(self) -> float:
    """The longest a save took from its start to its commit (measured when asked, so an upper
    bound by the time between calls); what stopping before a time limit must leave room for."""
    if self._save_started is not None and not self._manager.is_saving_in_progress():
      self._slowest_save_s = max(self._slowest_save_s, time.perf_counter() - self._save_started)
      self._save_started = None
    return max(self._slowest_save_s, self.last_blocked_s)

  def _raise_if_disk_full(self, error: BaseException) -> None:
    if not orbax_noise.is_disk_full(error):
      return
    step, nbytes = self._in_flight or (None, 0)
    self._in_flight, self._failed = None, True
    self._remove_partial_saves()
    self._manager.reload()
    last = self._manager.latest_step()
    intact = f'{self.directory}/{last}' if last is not None else 'none'
    raise DiskFullError(
      f'checkpoint {step} ran out of space in {self.directory} (each checkpoint needs about '
      f'{_gib(nbytes)}; checkpoint.keep={self.keep} + 1 are on disk while the next is written); '
      f'the last complete checkpoint is {intact}. Free space, lower --config.checkpoint.keep, '
      'raise --config.checkpoint.every, or set --config.output_dir to a larger disk.'
    ) from error

  def _remove_partial_saves(self) -> None:
    """Deletes the temporary directory of the save that failed, freeing its space."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if '.orbax-checkpoint-tmp' in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def restore(self, step: int, setup) -> tuple[dict, object]:
    """(train state in the setup's shardings, data iterator state) of `step`.

    Raises DamagedCheckpoint for unreadable or mismatching bytes, CheckpointError for a step
    that does not fit this run.
    """
    step_dir = os.path.join(self.directory, str(step))
    target = params_checkpoint.abstract(setup.state_shapes, setup.state_shardings)
    arrays = {k: v for k, v in target.items() if k != 'step'}  # params, opt_state[, reference]
    try:
      meta = step_meta.read_meta(step_dir)
    except (OSError, ValueError, run_dir_lib.CheckpointError) as e:
      raise step_meta.DamagedCheckpoint(f'meta: {orbax_noise.one_line(e)}') from e
    verified = step_meta.check_meta(meta, step, items=tuple(arrays))
    if not verified:
      _note(f'checkpoint {step_dir} predates checksums: its arrays load unverified.')
    compatibility.check_layout(step_dir, meta, arrays)
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in arrays.items()}),
      )
    except Exception as e:  # pylint: disable=broad-except
      # orbax and tensorstore raise many kinds for unreadable files; device OOM is not one.
      if 'RESOURCE_EXHAUSTED' in str(e) and 'OCDBT' not in str(e):
        raise
      orbax_noise.READ_FAILED.set()
      raise step_meta.DamagedCheckpoint(
        f'reading the arrays failed: {orbax_noise.one_line(e)}'
      ) from e
    got = {k: restored[k] for k in arrays}
    if verified:
      problems = []
      digests = checksums.to_hex(checksums.dispatch(got))
      for item in got:
        now = {k[len(item) + 1 :]: v for k, v in digests.items() if k.startswith(item + '/')}
        problems += [
          f'{item}/{p}' for p in checksums.compare(step_meta.saved_checksums(meta, item), now)
        ]
      if problems:
        raise step_meta.DamagedCheckpoint(
          '; '.join(problems[:3])
          + (f' (and {len(problems) - 3} more)' if len(problems) > 3 else '')
        )
    state = dict(step=jax.device_put(jax.numpy.int32(step), setup.replicated), **got)
    return state, meta.get('data_state')

  def wait(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_disk_full(e)
      raise
    self._in_flight = None

  def close(self) -> None:
    """Waits for saves in flight, then releases the manager; later calls do nothing."""
    if self._closed:
      return
    self._closed = True
    for thread in self._warm_ups:  # no warm-up left running into the interpreter's exit
      thread.join()
    if self._failed:  # the error was raised already; what orbax still holds is that same error
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        pass
      return
    try:
      self.wait()
    finally:
      self._manager.close()


def _warn(message: str) -> None:
  if jax.process_index() == 0:
    print(f'warning: {message}', file=sys.stderr, flush=True)


def _note(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _test_hooks():
  """orbax's temporary-path class with the fault hooks tests set (None when none is set):
  COMMIT_DELAY_ENV stalls one step's commit; DISK_FULL_ENV makes one step's write fail as a full
  disk does, after its files are written."""
  delay, full = os.environ.get(COMMIT_DELAY_ENV), os.environ.get(DISK_FULL_ENV)
  if not delay and not full:
    return None
  stall_step, seconds = delay.split(':') if delay else (None, '0')

  class HookedCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
    async def finalize(self, *args, **kwargs):
      name = self.get_final().name
      if name == full:
        raise OSError(errno.ENOSPC, 'No space left on device (test hook)', str(self.get()))
      if name == stall_step:
        print(f'test hook: stalling the commit of checkpoint {name} for {seconds}s', flush=True)
        await asyncio.sleep(float(seconds))
      return await super().finalize(*args, **kwargs)

  return HookedCommit
