"""A LoRA run's checkpoints as a model: the adapters of a step joined to the base they trained
on (restored from the run's init_from and checked against the checksum the run recorded).

A LoRA run's step directories hold the adapters alone (the train state's params); the base is
named in `<run>/lora_base.json` by path and checksum (train/lora_setup.py writes it).
"""

from __future__ import annotations

import hashlib
import json
import os
import types

import jax

from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums, init_from
from dlmjax.checkpoint import manager
from dlmjax.model import lora

BASE_FILE = 'lora_base.json'


def base_checksum(frozen: dict) -> str:
  """One sha256 over every frozen leaf's digest (checkpoint/checksums.py), mesh-independent."""
  digests = checksums.compute(frozen)
  return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def restore(run_dir: str, step_dir: str, config):
  """(ModelConfig with the adapters, adapters, frozen base) of a LoRA run's step, on one device."""
  cfg = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  _, shapes, _ = model_lib.abstract(cfg)
  adapter_shapes = lora.split(shapes)[0]
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  adapters = manager.restore_params(
    step_dir, adapter_shapes, jax.tree.map(lambda _: device, adapter_shapes)
  )
  recorded = _recorded_base(run_dir)
  source = config.copy_and_resolve_references()
  source.init_from = recorded.get('path', config.init_from)
  base = init_from.restore_params(source, types.SimpleNamespace(mesh=None), purpose='LoRA base')
  frozen = jax.jit(lambda p: lora.freeze(p, cfg, lora.storage_dtype(config)))(base)
  if recorded and base_checksum(frozen) != recorded['checksum']:
    raise manager.CheckpointError(
      f'the LoRA base {source.init_from} changed since {run_dir} trained on it (checksum '
      f'{recorded["checksum"][:12]}); restore that base, or export a run whose base matches.'
    )
  return cfg, adapters, frozen


def _recorded_base(run_dir: str) -> dict:
  path = os.path.join(run_dir, BASE_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)
