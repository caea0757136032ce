"""Params-only access to run checkpoints: conversion, verification, init_from and inference.

These readers and writers need the params item alone, never a run's optimizer or data state, so
they go through orbax's StandardCheckpointer on `<step>/params` rather than a RunCheckpoints.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import orbax_noise
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta

ADAPTER_SUFFIXES = ('_lora_a', '_lora_b')  # model/lora.py's names of a LoRA run's arrays


def abstract(shapes, shardings):
  """The restore target: `shapes` (ShapeDtypeStructs) placed as `shardings`."""
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def item_metadata(item_dir: str):
  """The shapes and dtypes orbax recorded for one saved item (a tree of array metadata)."""
  orbax_noise.quiet_item_metadata_notice()
  metadata = ocp.StandardCheckpointer().metadata(item_dir)
  return getattr(metadata, 'item_metadata', metadata)


def write_run_config(run_dir: str, config) -> None:
  if jax.process_index() == 0:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, run_dir_lib.CONFIG_FILE), 'w') as f:
      f.write(config.to_json(indent=2, sort_keys=True))


def restore_params(step_dir: str, shapes, shardings) -> dict:
  """The params of a step directory, read into `shapes` (ShapeDtypeStructs) placed as `shardings`
  (model.param_placement gives both for a config)."""
  path = os.path.join(os.path.abspath(step_dir), 'params')
  if not os.path.isdir(path):
    raise run_dir_lib.CheckpointError(f'{path} is missing: the checkpoint is incomplete.')
  try:
    orbax_noise.quiet_item_metadata_notice()
    return ocp.StandardCheckpointer().restore(path, abstract(shapes, shardings))
  except (ValueError, KeyError) as e:
    raise run_dir_lib.CheckpointError(_params_mismatch(path, shapes, e)) from e


def _params_mismatch(path: str, shapes, error) -> str:
  """One line naming what differs between the saved params and the model asked for: arrays the
  checkpoint lacks, arrays it has beyond the model, shapes or dtypes that differ (orbax's own
  message only where its metadata cannot be read)."""
  try:
    saved = step_meta.layout(item_metadata(path).tree)
  except Exception:  # pylint: disable=broad-except
    return (
      f'the params in {path} cannot be read into the model of its config '
      f'({orbax_noise.one_line(error)}).'
    )
  want = step_meta.layout(shapes)
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
    f'({"; ".join(parts) or orbax_noise.one_line(error)}).'
  )


def save_params_checkpoint(
  output_dir: str, config, params: dict, step: int = 0, source: dict | None = None
) -> str:
  """Writes a run directory holding only params (imports, exports); returns the step dir.
  `source` (an import's family and path) is kept in the step's metadata."""
  write_run_config(output_dir, config)
  directory = os.path.join(os.path.abspath(output_dir), run_dir_lib.CHECKPOINT_DIR)
  manager = ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(create=True), item_names=step_meta.ITEMS
  )
  meta = dict(
    step=step,
    data_state=None,
    checksum_format=checksums.FORMAT,
    checksums=checksums.compute(params),
    meta_checksum=step_meta.meta_digest(step, None),
    format=step_meta.META_FORMAT,
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
