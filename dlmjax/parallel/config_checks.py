"""The mesh.* keys against the model and the batch, checked beside the mesh they build
(registered with dlmjax.config's validation registry)."""

from __future__ import annotations

from dlmjax.config import (
  MESH_AXES,
  VOCAB_MULTIPLE,
  ConfigError,
  batch_parallelism,
  mesh_size,
  padded_vocab_size,
  pipeline_microbatches,
  registry,
)


@registry.check
def tensor_split(config):
  """The heads and the MLP split over mesh.tensor as given (before a -1 axis is resolved)."""
  m = config.model
  tensor = config.mesh.tensor
  for key in ('num_heads', 'num_kv_heads', 'ffn_dim'):
    if tensor > 0 and m[key] % tensor:
      raise ConfigError(
        f'model.{key}={m[key]} is not divisible by mesh.tensor={tensor}; '
        'pick a tensor size that divides it.'
      )


@registry.check(phase='mesh_axes')
def axes_pipeline_and_context(config):
  """Every axis >= 1, and the divisibility the pipeline schedule and the sequence split need."""
  m, mesh = config.model, config.mesh
  for axis in MESH_AXES:
    if mesh[axis] < 1:
      raise ConfigError(f'mesh.{axis}={mesh[axis]} must be >= 1 (or -1 to fill the devices).')
  if mesh.pipeline_repeats < 1 or mesh.pipeline_microbatches < 0:
    raise ConfigError(
      f'mesh.pipeline_repeats={mesh.pipeline_repeats} must be >= 1 and '
      f'mesh.pipeline_microbatches={mesh.pipeline_microbatches} >= 0 (0 = one per '
      'stage).'
    )
  if mesh.pipeline > 1:
    stages, repeats = mesh.pipeline, mesh.pipeline_repeats
    micro = pipeline_microbatches(config)
    if m.num_layers % (stages * repeats):
      raise ConfigError(
        f'model.num_layers={m.num_layers} is not divisible by mesh.pipeline x '
        f'mesh.pipeline_repeats = {stages} x {repeats}; every stage needs the '
        'same number of layers per repeat.'
      )
    if repeats > 1 and micro < stages:
      raise ConfigError(
        f'the circular pipeline (mesh.pipeline_repeats={repeats}) needs '
        f'mesh.pipeline_microbatches >= mesh.pipeline={stages}, got {micro}.'
      )
    rows = micro * batch_parallelism(config)
    if config.train.micro_batch_size % rows:
      raise ConfigError(
        f'train.micro_batch_size={config.train.micro_batch_size} does not split '
        f'into {micro} pipeline micro-batches over mesh.data x mesh.fsdp x mesh.expert = '
        f'{batch_parallelism(config)} devices; make it a multiple of {rows} or '
        'change mesh.pipeline_microbatches.'
      )
  if mesh.context > 1:
    if m.seq_len % mesh.context:
      raise ConfigError(
        f'model.seq_len={m.seq_len} is not divisible by mesh.context='
        f'{mesh.context}; every device holds an equal slice of the sequence.'
      )
    heads = mesh.tensor * mesh.context
    for key in ('num_heads', 'num_kv_heads'):
      if m[key] % heads:
        raise ConfigError(
          f'model.{key}={m[key]} is not divisible by mesh.tensor x mesh.context '
          f'= {heads}: context-parallel attention splits the heads over both; '
          'lower mesh.context or mesh.tensor.'
        )


@registry.check(phase='mesh')
def mesh_fits(config, num_devices):
  """The tensor split, the weights' sharding, the device count and the batch split."""
  m, mesh = config.model, config.mesh
  for key in ('num_heads', 'num_kv_heads', 'ffn_dim'):
    if m[key] % mesh.tensor:
      raise ConfigError(
        f'model.{key}={m[key]} is not divisible by mesh.tensor={mesh.tensor}; '
        'pick a tensor size that divides it.'
      )
  if padded_vocab_size(config) % mesh.tensor:
    raise ConfigError(
      f'the padded vocabulary ({padded_vocab_size(config)} rows, model.vocab_size rounded up to '
      f'{VOCAB_MULTIPLE}) is not divisible by mesh.tensor={mesh.tensor}; use a power-of-two '
      'tensor size.'
    )
  if m.d_model % (mesh.fsdp * mesh.context):
    raise ConfigError(
      f'model.d_model={m.d_model} is not divisible by mesh.fsdp x mesh.context = '
      f'{mesh.fsdp * mesh.context} (weights are sharded over both).'
    )
  total = mesh_size(config)
  if num_devices is not None and total > num_devices:
    raise ConfigError(
      f'the mesh needs {total} devices (data {mesh.data} x fsdp {mesh.fsdp} x '
      f'expert {mesh.expert} x tensor {mesh.tensor} x pipeline {mesh.pipeline} x context '
      f'{mesh.context}) but only {num_devices} '
      'exist; shrink the mesh axes.'
    )
  if num_devices is not None and total < num_devices:
    raise ConfigError(
      f'the mesh uses {total} of {num_devices} devices; make data x fsdp x expert x tensor '
      f'x pipeline x context = {num_devices}, or set one axis to -1 to fill '
      'them.'
    )
  dp = batch_parallelism(config)
  if config.train.micro_batch_size % dp:
    raise ConfigError(
      f'train.micro_batch_size={config.train.micro_batch_size} is not divisible by '
      f'the batch-parallel devices mesh.data x mesh.fsdp x mesh.expert = {dp}; set '
      f'--config.train.micro_batch_size to a multiple of {dp}.'
    )
