"""Model names: a local path as it is, or a Hugging Face Hub id `org/name[@revision]`.

Every entry point that reads a model (init_from, convert from-hf, load_pretrained and so generate,
evaluate and the server) passes its path through `resolve`, the one place a hub id becomes a
directory. huggingface_hub's cache answers first (the layout `snapshot_download` writes:
models--org--name/snapshots/<commit>/ with refs/<branch> naming the commit); with HF_HUB_OFFLINE
set nothing is downloaded; online a model missing from the cache is downloaded into it.
"""

from __future__ import annotations

import os
import re

from dlmjax.checkpoint import run_dir

# huggingface_hub's repo id rules: org and name of letters, digits, '-', '_', '.'; the revision
# is a branch, tag or commit.
_HUB_ID = re.compile(
  r'^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$'
)
# What a snapshot needs for our readers: config, safetensors weights, tokenizer, modeling code.
# Other weight formats (PyTorch .bin, GGUF, ONNX, Flax) are never read, so never downloaded.
_IGNORED = ['*.bin', '*.pt', '*.pth', '*.gguf', '*.onnx', '*.msgpack', '*.h5', '*.ckpt']
_TRUE = ('1', 'ON', 'YES', 'TRUE')


class HubError(run_dir.CheckpointError):
  """A hub id that cannot be resolved: the message names the id and the cache."""


def parse_id(path: str) -> tuple[str, str | None] | None:
  """(repo_id, revision) of a hub id, or None for something that is not one."""
  match = _HUB_ID.match(path)
  return (match['repo'], match['revision']) if match else None


def cache_dir() -> str:
  """huggingface_hub's cache, read from the environment at call time (HF_HUB_CACHE, HF_HOME)."""
  if os.environ.get('HF_HUB_CACHE'):
    return os.environ['HF_HUB_CACHE']
  if os.environ.get('HF_HOME'):
    return os.path.join(os.environ['HF_HOME'], 'hub')
  return os.path.join(os.path.expanduser('~'), '.cache', 'huggingface', 'hub')


def offline() -> bool:
  return os.environ.get('HF_HUB_OFFLINE', '').upper() in _TRUE


def resolve(path: str) -> str:
  """A local path unchanged (existing, or not a hub id); a hub id as its snapshot directory."""
  if not path or os.path.exists(path):
    return path
  parsed = parse_id(path)
  if parsed is None or os.path.isdir(path.split('/')[0]):
    return path  # not a hub id, or a missing path under a local directory (runs/...)
  repo_id, revision = parsed
  # Neither a local directory nor (yet) a hub snapshot: a run not trained yet reads like an id.
  what = f'{path!r} is no local directory (if it names a run, train that run first) '
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel
    from huggingface_hub import errors  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise HubError(
      f'{what}and reading it from the Hugging Face Hub needs '
      'huggingface_hub: pip install -e ".[torch]" (or pip install huggingface_hub).'
    ) from e
  cache = cache_dir()
  try:
    return huggingface_hub.snapshot_download(
      repo_id, revision=revision, cache_dir=cache, local_files_only=True
    )
  except (errors.LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
    pass  # not in the cache (or only part of it)
  if offline():
    raise HubError(
      f'{what}and not in the Hugging Face cache {cache} (HF_HUB_OFFLINE is '
      f'set, so nothing is downloaded): download it where there is a network '
      f'(huggingface-cli download {repo_id}), or name a local directory.'
    )
  try:
    return huggingface_hub.snapshot_download(
      repo_id, revision=revision, cache_dir=cache, ignore_patterns=_IGNORED
    )
  except Exception as e:  # noqa: BLE001  (network, auth, unknown repo: all end the same way)
    raise HubError(
      f'{what}and could not be downloaded from the Hugging Face Hub into '
      f'{cache} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); check the id, '
      'the network and HF_TOKEN for gated models, or name a local directory.'
    ) from e
