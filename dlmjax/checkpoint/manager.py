"""Orbax checkpoints of a run: save, resume, and params-only restore for other stages and tools.

A step directory `<run>/checkpoints/<step>/` holds three orbax items: `params` (the model),
`opt_state` (absent in params-only checkpoints, e.g. imports) and `meta` (JSON: step and the data
iterator state). Restores go straight into the target shardings; nothing is gathered on one host.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp

from dlmjax import config as config_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import host_transfer
from dlmjax.checkpoint import run_dir as run_dir_lib

# A run directory's layout, its saved config and the step a path names are read without orbax
# (checkpoint/run_dir.py); they are named here too for the readers of checkpoints.
CONFIG_FILE = run_dir_lib.CONFIG_FILE
CHECKPOINT_DIR = run_dir_lib.CHECKPOINT_DIR
CheckpointError = run_dir_lib.CheckpointError
load_run_config = run_dir_lib.load_run_config
resolve_step_dir = run_dir_lib.resolve_step_dir
_ITEMS = ('params', 'opt_state', 'reference', 'meta')  # reference: RL's refreshed KL reference
# Keys that must match between a checkpoint and the run resuming from it: those the config
# declares as fixing the parameters' shapes (init_from compares only these) or the sample/mask
# streams. Run-time knobs (backend, remat, mesh) may change.
_ARCHITECTURE_KEYS = config_lib.ARCHITECTURE_KEYS
_RESUME_KEYS = config_lib.ARCHITECTURE_KEYS + config_lib.STREAM_KEYS
# The meta item's version marker. A meta that carries it, or any of the integrity keys, was
# written by a version that records checksums and must hold all of them; only a meta with none
# (a checkpoint from before checksums) loads unverified, and says so (docs/faults.md, Integrity).
META_FORMAT = 2
_INTEGRITY_KEYS = ('checksums', 'checksum_format', 'meta_checksum')
# Steps kept out of rotation: the last good checkpoint before a detected divergence.
PINNED_FILE = 'pinned.json'
# Test hook, "STEP:SECONDS": stall the commit of that step's save (its files written, the step not
# yet committed), so a test can kill the process mid-save deterministically.
COMMIT_DELAY_ENV = 'DLMJAX_TEST_COMMIT_DELAY'
# Test hook, "STEP": the save of that step fails as on a full disk (ENOSPC), after writing.
DISK_FULL_ENV = 'DLMJAX_TEST_DISK_FULL'


class DiskFullError(CheckpointError):
  """A save ran out of space; the message names the directory, the space and the knobs."""


class DamagedCheckpoint(Exception):
  """The bytes of one step are unreadable or do not match their checksums (set aside)."""


def _abstract(shapes, shardings):
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def _layout(tree) -> dict[str, str]:
  """{'params/embed/embedding': 'float32[4096,64]', ...}: what a restore target must match."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    checksums._path_name(path): f'{jax.numpy.dtype(x.dtype).name}{list(x.shape)}'  # pylint: disable=protected-access
    for path, x in leaves
  }


def _meta_digest(step: int, data_state) -> str:
  """sha256 of the step and data-iterator state (the meta item's own checksum)."""
  text = json.dumps(dict(step=step, data_state=data_state), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()


def saved_checksums(meta: dict, item: str = 'params') -> dict | None:
  """The digests saved for `item` ('params' or 'opt_state'), or None when this checkpoint holds
  none in the current format (saved before it existed: nothing to compare with)."""
  if meta.get('checksum_format') != checksums.FORMAT:
    return None
  return meta.get('checksums' if item == 'params' else f'{item}_checksums')


def predates_checksums(meta: dict) -> bool:
  """Whether the meta comes from before checksums were written: no version marker and none of
  the integrity keys (a later meta missing some of them is damaged, not old)."""
  return 'format' not in meta and not any(k in meta for k in _INTEGRITY_KEYS + ('layout',))


def check_meta(meta: dict, step: int, items=('params',)) -> bool:
  """Raises DamagedCheckpoint unless the meta item is whole and its step and data state match
  their sha256; `items` are the array items to be read. Returns False for a checkpoint from
  before checksums (nothing to verify), True when every digest is there to compare.

  The one test of a step's meta for both resume and `python -m dlmjax.verify`."""
  if meta.get('step') != step:
    raise DamagedCheckpoint(f'meta: the step ({meta.get("step")!r}) is not {step}')
  if predates_checksums(meta):
    return False
  wanted = list(_INTEGRITY_KEYS) + [f'{i}_checksums' for i in items if i != 'params']
  missing = [k for k in wanted if k not in meta]
  if missing:
    raise DamagedCheckpoint(
      f'meta: {", ".join(missing)} missing, though it was written by a version that records them'
    )
  if meta['checksum_format'] != checksums.FORMAT:
    raise DamagedCheckpoint(
      f'meta: checksum_format {meta["checksum_format"]!r} is not {checksums.FORMAT!r}, the '
      'only one this version writes'
    )
  if meta['meta_checksum'] != _meta_digest(step, meta.get('data_state')):
    raise DamagedCheckpoint(
      f'meta: the step ({step}) or data-iterator state does not match its checksum'
    )
  return True


def _is_disk_full(error: BaseException) -> bool:
  while error is not None:
    if getattr(error, 'errno', None) == errno.ENOSPC or 'No space left on device' in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


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
    self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR)
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
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    _quiet_disk_full_tracebacks()
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
      raise CheckpointError(
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
      except DamagedCheckpoint as e:
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
    raise CheckpointError(
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
      meta_checksum=_meta_digest(step, data_state),
      layout=_layout(arrays),
      format=META_FORMAT,
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
    if not _is_disk_full(error):
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
    target = _abstract(setup.state_shapes, setup.state_shardings)
    arrays = {k: v for k, v in target.items() if k != 'step'}  # params, opt_state[, reference]
    try:
      meta = read_meta(step_dir)
    except (OSError, ValueError, CheckpointError) as e:
      raise DamagedCheckpoint(f'meta: {_one_line(e)}') from e
    verified = check_meta(meta, step, items=tuple(arrays))
    if not verified:
      _note(f'checkpoint {step_dir} predates checksums: its arrays load unverified.')
    _check_layout(step_dir, meta, arrays)
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in arrays.items()}),
      )
    except Exception as e:  # pylint: disable=broad-except
      # orbax and tensorstore raise many kinds for unreadable files; device OOM is not one.
      if 'RESOURCE_EXHAUSTED' in str(e) and 'OCDBT' not in str(e):
        raise
      _READ_FAILED.set()
      raise DamagedCheckpoint(f'reading the arrays failed: {_one_line(e)}') from e
    got = {k: restored[k] for k in arrays}
    if verified:
      problems = []
      digests = checksums.to_hex(checksums.dispatch(got))
      for item in got:
        now = {k[len(item) + 1 :]: v for k, v in digests.items() if k.startswith(item + '/')}
        problems += [f'{item}/{p}' for p in checksums.compare(saved_checksums(meta, item), now)]
      if problems:
        raise DamagedCheckpoint(
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


class _DropItemMetadataNotice(logging.Filter):
  """A step's checkpoint metadata lives in the step directory (CheckpointManager writes it
  there), so orbax reading one item's directory on its own (params/) warns that the item has
  none: true, expected, and noise on every restore and `verify`. Exactly those records drop."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Metadata file does not exist')


def _quiet_item_metadata_notice() -> None:
  logger = logging.getLogger('absl')
  if not any(isinstance(f, _DropItemMetadataNotice) for f in logger.filters):
    logger.addFilter(_DropItemMetadataNotice())


def item_metadata(item_dir: str):
  """The shapes and dtypes orbax recorded for one saved item (a tree of array metadata)."""
  _quiet_item_metadata_notice()
  metadata = ocp.StandardCheckpointer().metadata(item_dir)
  return getattr(metadata, 'item_metadata', metadata)


def _check_layout(step_dir, meta, arrays) -> None:
  """CheckpointError (one line, nothing touched) when the saved arrays' shapes or dtypes are
  not this run's: a changed model, never damage (a mesh change keeps every shape)."""
  saved = meta.get('layout')
  if saved is None:  # saved before layouts were recorded: orbax's own metadata of each item
    try:
      saved = _layout({item: item_metadata(os.path.join(step_dir, item)) for item in arrays})
    except Exception as e:  # pylint: disable=broad-except
      raise DamagedCheckpoint(f'array metadata: {_one_line(e)}') from e
  want = _layout(arrays)
  differing = [
    f'{k}: checkpoint {saved.get(k, "absent")}, run {want.get(k, "absent")}'
    for k in sorted(set(saved) | set(want), key=lambda k: (not k.startswith('params/'), k))
    if saved.get(k) != want.get(k)
  ]
  if differing:
    raise CheckpointError(
      f"the checkpoint {step_dir} holds arrays of other shapes than this run's model "
      f'({"; ".join(differing[:3])}{" ..." if len(differing) > 3 else ""}); it was left as '
      "it is. Use a new --config.output_dir, or set the model keys back to the checkpoint's "
      '(its config.json).'
    )


class _DropDiskFullTracebacks(logging.Filter):
  """orbax logs a failed background write with its traceback before re-raising it; a full disk
  is reported as one error line (DiskFullError), so those records are dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and _is_disk_full(record.exc_info[1]))


def _quiet_disk_full_tracebacks() -> None:
  for name in ('absl', 'asyncio'):  # orbax's logs; asyncio's "Future exception never retrieved"
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropDiskFullTracebacks) for f in logger.filters):
      logger.addFilter(_DropDiskFullTracebacks())
  _quiet_writes_after_the_loop_closed()


def _quiet_writes_after_the_loop_closed() -> None:
  """When a save fails (a full disk), tensorstore's writes still pending finish after orbax's
  background thread closed its event loop, each reporting `RuntimeError: Event loop is closed`
  from loop.call_soon_threadsafe through sys.unraisablehook: a traceback apiece, printed before
  the run's one error line. Exactly those reports are dropped (installed with the manager: they
  come before the failure reaches the training thread)."""
  previous = sys.unraisablehook
  if getattr(previous, 'dlmjax_quiet', False):
    return

  def hook(unraisable):
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    closed_loop = isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
    if closed_loop and tb is not None and tb.tb_frame.f_code.co_name == 'call_soon_threadsafe':
      return
    if _READ_FAILED.is_set() and inspect.iscoroutine(unraisable.object):
      return  # the reads a damaged step's failure abandoned, reported as it is set aside
    previous(unraisable)

  hook.dlmjax_quiet = True
  sys.unraisablehook = hook


# Set once reading a step's arrays failed: orbax leaves the other reads of that restore
# un-awaited, and each coroutine's collection printed an `Exception ignored in: <coroutine ...>`
# traceback after the one warning. From then on those reports (and only those) are dropped.
_READ_FAILED = threading.Event()
_NOISE = re.compile(r'\[(source locations|tensorstore_spec)=.*?\](?= \[|$)')


def _one_line(error: BaseException) -> str:
  """The error as one line that names the file and the status: the innermost error of the
  chain (tensorstore's `OUT_OF_RANGE: Error reading "<array>" ... at local file "<dir>"`),
  not orbax's wrapper, whose text is a TensorStore spec's repr."""
  chain = [error]
  while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if len(chain) > 20:
      break
  chosen = next((e for e in reversed(chain) if _STATUS.match(str(e))), chain[-1])
  text = _NOISE.sub('', ' '.join(str(chosen).split())).strip()
  return f'{type(chosen).__name__}: {text[:400]}'


_STATUS = re.compile(r'[A-Z][A-Z_]+: ')  # absl status codes: NOT_FOUND, DATA_LOSS, ...


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


# ----------------------------------------------------------------------------------------------
# Run directories and params-only access (conversion, verification, init_from, inference)


def write_run_config(run_dir: str, config) -> None:
  if jax.process_index() == 0:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, CONFIG_FILE), 'w') as f:
      f.write(config.to_json(indent=2, sort_keys=True))


def read_meta(step_dir: str) -> dict:
  """The step's JSON item: step, data iterator state and the params' sha256 checksums."""
  path = os.path.join(step_dir, 'meta', 'metadata')
  if not os.path.exists(path):
    raise CheckpointError(f'{path} is missing: the checkpoint is incomplete.')
  with open(path) as f:
    return json.load(f)


def restore_params(step_dir: str, shapes, shardings) -> dict:
  """The params of a step directory, read into `shapes` (ShapeDtypeStructs) placed as `shardings`
  (model.param_placement gives both for a config)."""
  path = os.path.join(os.path.abspath(step_dir), 'params')
  if not os.path.isdir(path):
    raise CheckpointError(f'{path} is missing: the checkpoint is incomplete.')
  try:
    _quiet_item_metadata_notice()
    return ocp.StandardCheckpointer().restore(path, _abstract(shapes, shardings))
  except (ValueError, KeyError) as e:
    raise CheckpointError(_params_mismatch(path, shapes, e)) from e


ADAPTER_SUFFIXES = ('_lora_a', '_lora_b')  # model/lora.py's names of a LoRA run's arrays


def _params_mismatch(path: str, shapes, error) -> str:
  """One line naming what differs between the saved params and the model asked for: arrays the
  checkpoint lacks, arrays it has beyond the model, shapes or dtypes that differ (orbax's own
  message only where its metadata cannot be read)."""
  try:
    saved = _layout(item_metadata(path).tree)
  except Exception:  # pylint: disable=broad-except
    return f'the params in {path} cannot be read into the model of its config ({_one_line(error)}).'
  want = _layout(shapes)
  if saved and all(k.endswith(ADAPTER_SUFFIXES) for k in saved):
    return (
      f'the params in {path} are the adapters of a LoRA run, not a whole model: read the run '
      'through checkpoint/run_model.py (dlmjax.load_pretrained, convert and init_from do), '
      'which joins them to their base.'
    )
  lacks = sorted(set(want) - set(saved))
  extra = sorted(set(saved) - set(want))
  shaped = [f'{k} {saved[k]} (model {want[k]})' for k in sorted(set(saved) & set(want))]
  shaped = [s for s, k in zip(shaped, sorted(set(saved) & set(want))) if saved[k] != want[k]]
  parts = [
    f'{label}: {", ".join(items[:3])}{f" and {len(items) - 3} more" if len(items) > 3 else ""}'
    for label, items in (
      ('the checkpoint lacks', lacks),
      ('it holds arrays the model has not', extra),
      ('shaped otherwise', shaped),
    )
    if items
  ]
  return (
    f'the params in {path} are not the model its config describes '
    f'({"; ".join(parts) or _one_line(error)}).'
  )


def save_params_checkpoint(
  output_dir: str, config, params: dict, step: int = 0, source: dict | None = None
) -> str:
  """Writes a run directory holding only params (imports, exports); returns the step dir.
  `source` (an import's family and path) is kept in the step's metadata."""
  write_run_config(output_dir, config)
  directory = os.path.join(os.path.abspath(output_dir), CHECKPOINT_DIR)
  manager = ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(create=True), item_names=_ITEMS
  )
  meta = dict(
    step=step,
    data_state=None,
    checksum_format=checksums.FORMAT,
    checksums=checksums.compute(params),
    meta_checksum=_meta_digest(step, None),
    format=META_FORMAT,
  )
  if source is not None:
    meta['source'] = source
  manager.save(
    step,
    args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
    force=True,
  )
  manager.wait_until_finished()
  manager.close()
  return os.path.join(directory, str(step))


def check_resumable(saved, config, *, keys=_RESUME_KEYS) -> None:
  """Raises CheckpointError listing keys whose change would make a resume wrong."""
  differing = []
  for key in keys:
    a, b = config_lib.get_key(saved, key), config_lib.get_key(config, key)
    if a != b:
      differing.append(f'{key}: checkpoint {a!r}, run {b!r}')
  if differing:
    raise CheckpointError(
      'the checkpoint in output_dir was made with a different config ('
      + '; '.join(differing)
      + '). Use a new --config.output_dir, or set '
      "these keys back to the checkpoint's values."
    )


def check_architecture(saved, config) -> None:
  """For init_from: only the architecture has to match."""
  check_resumable(saved, config, keys=_ARCHITECTURE_KEYS)
