"""A LoRA run's checkpoints as a model: the adapters of a step joined to the base they trained
on (restored from the run's init_from and checked against the checksum the run recorded).

A LoRA run's step directories hold the adapters alone (the train state's params); the base is
named in `<run>/lora_base.json` by path, the checksum of its frozen arrays and the fingerprint of
its files (train/lora_setup.py writes it). A resume or an export whose base files still have the
recorded names, sizes and modification times takes the recorded checksum as the base's, without
hashing the arrays again; otherwise (a copy, a rewrite, a touch) it hashes them and compares.
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


def source_fingerprint(path: str) -> str:
  """sha256 over (relative name, size, mtime in ns) of every file under the base's init_from
  path: milliseconds, no file is read ('' for a path with no files). Any rewrite of a file
  changes its mtime (and nearly any its size), so an equal fingerprint means the bytes the
  checksum was taken of."""
  path = os.path.abspath(path)
  entries = []
  if os.path.isdir(path):
    for root, dirs, files in os.walk(path):
      dirs.sort()
      for name in sorted(files):
        full = os.path.join(root, name)
        stat = os.stat(full)
        entries.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
  elif os.path.isfile(path):
    stat = os.stat(path)
    entries.append(('', stat.st_size, stat.st_mtime_ns))
  if not entries:  # not a local path (nothing to stat): never taken as unchanged
    return ''
  return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def base_record(path: str, frozen: dict) -> dict:
  """What lora_base.json holds of a base restored from `path` (hashes its arrays once)."""
  return dict(
    path=os.path.abspath(path), checksum=base_checksum(frozen), fingerprint=source_fingerprint(path)
  )


def check_base(recorded: dict, path: str, frozen: dict) -> str | None:
  """None when the base restored from `path` is the recorded one: the same path and file
  fingerprint (the checksum is then taken as recorded) or, failing that, the same checksum of
  its arrays; else the checksum it has now."""
  fingerprint = recorded.get('fingerprint')
  if fingerprint and os.path.abspath(path) == recorded.get('path'):
    if fingerprint == source_fingerprint(path):
      return None
  checksum = base_checksum(frozen)
  return None if checksum == recorded['checksum'] else checksum


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
  if recorded and check_base(recorded, source.init_from, frozen) is not None:
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
