"""A LoRA run's record of its base: which base its adapters trained on, and whether a base
restored now is that one (checkpoint/run_model.py joins the two).

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

from dlmjax.checkpoint import checksums

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


def recorded_base(run_dir: str) -> dict:
  """What the run recorded of its base ({} for a run saved before the record existed)."""
  path = os.path.join(run_dir, BASE_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)
