"""Orbax checkpoints of a run: save, resume, and params-only restore for other stages and tools.

A step directory `<run>/checkpoints/<step>/` holds three orbax items: `params` (the model),
`opt_state` (absent in params-only checkpoints, e.g. imports) and `meta` (JSON: step and the data
iterator state). Restores go straight into the target shardings; nothing is gathered on one host.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import jax
import ml_collections
import orbax.checkpoint as ocp

from dlmjax import config as config_lib
from dlmjax.checkpoint import checksums

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'
_ITEMS = ('params', 'opt_state', 'meta')
# Keys that must match between a checkpoint and the run resuming from it: they change the
# parameters' shapes or the sample/mask streams. Run-time knobs (backend, remat, mesh) may change.
_RESUME_KEYS = (
  'model.num_layers',
  'model.d_model',
  'model.num_heads',
  'model.num_kv_heads',
  'model.head_dim',
  'model.ffn_dim',
  'model.vocab_size',
  'model.tie_embeddings',
  'model.qk_norm',
  'model.qkv_bias',
  'model.shift_logits',
  'seed',
  'train.global_batch_size',
  'diffusion.objective',
)
_ARCHITECTURE_KEYS = _RESUME_KEYS[:11]
# Test hook, "STEP:SECONDS": stall the commit of that step's save (its files written, the step not
# yet committed), so a test can kill the process mid-save deterministically.
COMMIT_DELAY_ENV = 'DLMJAX_TEST_COMMIT_DELAY'


class CheckpointError(RuntimeError):
  """A checkpoint that is missing, incomplete or incompatible; the message names the fix."""


def _abstract(shapes, shardings):
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


class RunCheckpoints:
  """The checkpoints of one run directory."""

  def __init__(self, run_dir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      create=True,
      # a save killed mid-write leaves a temporary dir
      cleanup_tmp_directories=True,
      temporary_path_class=_commit_delay_hook(),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    self._closed = False

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, setup) -> tuple[dict, object]:
    """The newest checkpoint that restores and matches its params' checksums.

    orbax commits a step atomically (written to a temporary directory, then renamed), so a crash
    mid-save leaves no step behind; a step damaged later (truncated files, bit flips) is renamed
    to `<step>.corrupt` with a warning naming it, and the one before it is tried.
    """
    problems = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        state, data_state = self.restore(step, setup)
        self._verify(step, state['params'])
      except Exception as e:  # pylint: disable=broad-except
        # Any failure to read one step (orbax and tensorstore raise many kinds) means: try the
        # previous one. Config mismatches were ruled out before (check_resumable); running out
        # of memory says nothing about the files.
        if 'RESOURCE_EXHAUSTED' in str(e):
          raise
        problem = f'{self.directory}/{step}: {type(e).__name__}: {str(e)[:500]}'
        problems.append(problem)
        moved = self._set_aside(step)
        _warn(
          f'checkpoint {problem}; skipping it (kept as {moved}) and falling back to the '
          'previous checkpoint.'
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

  def _verify(self, step: int, params) -> None:
    meta = read_meta(os.path.join(self.directory, str(step)))
    if not meta.get('checksums'):  # saved before checksums existed
      return
    problems = checksums.compare(meta['checksums'], checksums.compute(params))
    if problems:
      raise CheckpointError(
        'params do not match the checksums saved with them ('
        + '; '.join(problems[:3])
        + (' ...' if len(problems) > 3 else '')
        + ')'
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
    """Starts an (async) save; the params' checksums go in the same atomic commit."""
    step = int(jax.device_get(state['step']))
    meta = dict(step=step, data_state=data_state, checksums=checksums.compute(state['params']))
    self._manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(state['params']),
        opt_state=ocp.args.StandardSave(state['opt_state']),
        meta=ocp.args.JsonSave(meta),
      ),
      force=True,
    )

  def restore(self, step: int, setup) -> tuple[dict, object]:
    """(train state in the setup's shardings, data iterator state) of `step`."""
    target = _abstract(setup.state_shapes, setup.state_shardings)
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target['params']),
        opt_state=ocp.args.StandardRestore(target['opt_state']),
        meta=ocp.args.JsonRestore(),
      ),
    )
    meta = restored['meta']
    state = dict(
      step=jax.device_put(jax.numpy.int32(meta['step']), setup.replicated),
      params=restored['params'],
      opt_state=restored['opt_state'],
    )
    return state, meta['data_state']

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for saves in flight, then releases the manager; later calls do nothing."""
    if self._closed:
      return
    self._closed = True
    self._manager.wait_until_finished()
    self._manager.close()


def _warn(message: str) -> None:
  if jax.process_index() == 0:
    print(f'warning: {message}', file=sys.stderr, flush=True)


def _commit_delay_hook():
  """orbax's temporary-path class, stalled before the commit of one step (COMMIT_DELAY_ENV)."""
  hook = os.environ.get(COMMIT_DELAY_ENV)
  if not hook:
    return None
  step, seconds = hook.split(':')

  class StalledCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
    async def finalize(self, *args, **kwargs):
      if self.get_final().name == step:
        print(f'test hook: stalling the commit of checkpoint {step} for {seconds}s', flush=True)
        await asyncio.sleep(float(seconds))
      return await super().finalize(*args, **kwargs)

  return StalledCommit


# ----------------------------------------------------------------------------------------------
# Run directories and params-only access (conversion, verification, init_from, inference)


def write_run_config(run_dir: str, config) -> None:
  if jax.process_index() == 0:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, CONFIG_FILE), 'w') as f:
      f.write(config.to_json(indent=2, sort_keys=True))


def load_run_config(run_dir: str) -> ml_collections.ConfigDict:
  path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise CheckpointError(f'{path} is missing: {run_dir} is not a dlmjax run directory.')
  with open(path) as f:
    return config_lib.from_dict(json.load(f))


def resolve_step_dir(path: str) -> tuple[str, str, int]:
  """(run_dir, step_dir, step) for a run directory (its latest step) or a step directory."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f'checkpoint path {path} does not exist.')
  if os.path.exists(os.path.join(path, CONFIG_FILE)):
    steps = _committed_steps(os.path.join(path, CHECKPOINT_DIR))
    if not steps:
      raise CheckpointError(
        f'run directory {path} has no complete checkpoint under {CHECKPOINT_DIR}/.'
      )
    return path, os.path.join(path, CHECKPOINT_DIR, str(steps[-1])), steps[-1]
  parent = os.path.dirname(path)
  name = os.path.basename(path)
  if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:
    if not os.path.isdir(os.path.join(path, 'params')):
      raise CheckpointError(f'{path} has no params item: the checkpoint is incomplete.')
    return os.path.dirname(parent), path, int(name)
  raise CheckpointError(
    f'{path} is neither a run directory (with {CONFIG_FILE}) nor a '
    f'checkpoint step directory (<run>/{CHECKPOINT_DIR}/<step>).'
  )


def _committed_steps(directory: str) -> list[int]:
  if not os.path.isdir(directory):
    return []
  return sorted(
    int(n)
    for n in os.listdir(directory)
    if n.isdigit() and os.path.isdir(os.path.join(directory, n, 'params'))
  )


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
    return ocp.StandardCheckpointer().restore(path, _abstract(shapes, shardings))
  except (ValueError, KeyError) as e:
    raise CheckpointError(
      f'the params in {path} do not match the model of its config ({e}); was the config edited?'
    ) from e


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
  meta = dict(step=step, data_state=None, checksums=checksums.compute(params))
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
