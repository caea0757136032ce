"""Whether a checkpoint fits the run that reads it: its config keys and its arrays' layout.

A misfit is the user's choice of model or seed, never damage: it raises CheckpointError with one
line naming what differs and the fix, and nothing is renamed or deleted.
"""

from __future__ import annotations

import os

from dlmjax import config as config_lib
from dlmjax.checkpoint import orbax_noise
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta

# Keys that must match between a checkpoint and the run resuming from it: those the config
# declares as fixing the parameters' shapes (init_from compares only these) or the sample/mask
# streams. Run-time knobs (backend, remat, mesh) may change.
_ARCHITECTURE_KEYS = config_lib.ARCHITECTURE_KEYS
_RESUME_KEYS = config_lib.ARCHITECTURE_KEYS + config_lib.STREAM_KEYS


def check_resumable(saved, config, *, keys=_RESUME_KEYS) -> None:
  """Raises CheckpointError listing keys whose change would make a resume wrong."""
  differing = []
  for key in keys:
    a, b = config_lib.get_key(saved, key), config_lib.get_key(config, key)
    if a != b:
      differing.append(f'{key}: checkpoint {a!r}, run {b!r}')
  if differing:
    raise run_dir_lib.CheckpointError(
      'the checkpoint in output_dir was made with a different config ('
      + '; '.join(differing)
      + '). Use a new --config.output_dir, or set '
      "these keys back to the checkpoint's values."
    )


def check_architecture(saved, config) -> None:
  """For init_from: only the architecture has to match."""
  check_resumable(saved, config, keys=_ARCHITECTURE_KEYS)


def check_layout(step_dir, meta, arrays) -> None:
  """CheckpointError (one line, nothing touched) when the saved arrays' shapes or dtypes are
  not this run's: a changed model, never damage (a mesh change keeps every shape)."""
  saved = meta.get('layout')
  if saved is None:  # saved before layouts were recorded: orbax's own metadata of each item
    try:
      saved = step_meta.layout(
        {item: params_checkpoint.item_metadata(os.path.join(step_dir, item)) for item in arrays}
      )
    except Exception as e:  # pylint: disable=broad-except
      raise step_meta.DamagedCheckpoint(f'array metadata: {orbax_noise.one_line(e)}') from e
  want = step_meta.layout(arrays)
  differing = [
    f'{k}: checkpoint {saved.get(k, "absent")}, run {want.get(k, "absent")}'
    for k in sorted(set(saved) | set(want), key=lambda k: (not k.startswith('params/'), k))
    if saved.get(k) != want.get(k)
  ]
  if differing:
    raise run_dir_lib.CheckpointError(
      f"the checkpoint {step_dir} holds arrays of other shapes than this run's model "
      f'({"; ".join(differing[:3])}{" ..." if len(differing) > 3 else ""}); it was left as '
      "it is. Use a new --config.output_dir, or set the model keys back to the checkpoint's "
      '(its config.json).'
    )
