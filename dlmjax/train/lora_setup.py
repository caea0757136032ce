"""What a LoRA run (train.lora.rank > 0) adds to the train setup: the model with adapters, the
frozen base in train.lora.base_dtype, the adapters' first values and the base's identity.

The train state's `params` are the adapters alone, so the gradient, the optimizer state and the
checkpoints hold nothing else; the base is restored from init_from (on resume too), converted
once to its storage dtype and passed to every program beside them (docs/lora.md).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.checkpoint import lora_checkpoint
from dlmjax.model import lora, score_head


def enabled(config) -> bool:
  return config.train.lora.rank > 0


def frozen_shapes(base_shapes, config):
  """The base's abstract arrays in their frozen storage (float leaves in the base dtype)."""
  dtype = lora.storage_dtype(config)
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, dtype if _is_float(s.dtype) else s.dtype),
    base_shapes,
  )


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def freeze(base: dict, cfg, config) -> dict:
  """The base in train.lora.base_dtype (model/lora.py freeze). Jit it with out_shardings."""
  return lora.freeze(base, cfg, lora.storage_dtype(config))


def init_adapters(adapter_shapes: dict, seed: int, init_std: float) -> dict:
  """Fresh adapters: A as PEFT draws it, B zero (the model starts as its base); a reward model's
  score head as model/score_head.py draws it (N(0, init_std))."""
  key = jax.random.fold_in(jax.random.key(seed), 0x10AA)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(adapter_shapes)
  values = []
  for i, (path, shape) in enumerate(leaves):
    name = str(path[-1].key)
    if name == score_head.KEY:
      values.append(score_head.fresh(seed, shape.shape[0], init_std))
    elif name.endswith(lora.A_SUFFIX):
      contract = lora.contract_ndim_of(name.removesuffix(lora.A_SUFFIX))
      values.append(lora.init_a(jax.random.fold_in(key, i), shape.shape, contract))
    else:
      values.append(jnp.zeros(shape.shape, jnp.float32))
  return treedef.unflatten(values)


def record_or_check_base(run_dir: str, path: str, frozen: dict, *, resuming: bool) -> None:
  """Writes the base's identity into a new run; a resumed run refuses a base that changed. The
  check costs a stat of the base's files when they are unchanged (checkpoint/lora_checkpoint.py,
  check_base); the arrays are hashed only when they are not."""
  file = os.path.join(run_dir, lora_checkpoint.BASE_FILE)
  if resuming and os.path.exists(file):
    with open(file) as f:
      saved = json.load(f)
    checksum = lora_checkpoint.check_base(saved, path, frozen)
    if checksum is not None:
      raise config_lib.ConfigError(
        f'the LoRA base changed since this run started: {path} has checksum {checksum[:12]}, '
        f'the run trained on {saved["path"]} with {saved["checksum"][:12]}; resume with that '
        'base or start a new --config.output_dir.'
      )
    fingerprint = lora_checkpoint.source_fingerprint(path)
    if saved.get('fingerprint') == fingerprint and saved['path'] == os.path.abspath(path):
      return
    saved = dict(saved, path=os.path.abspath(path), fingerprint=fingerprint)  # same arrays
  else:
    saved = lora_checkpoint.base_record(path, frozen)
  if jax.process_index() == 0:
    with open(file, 'w') as f:
      json.dump(saved, f, indent=1)


_RESUME_KEYS = ('rank', 'alpha', 'targets', 'base_dtype')


def check_resumable(saved, config) -> None:
  """The adapters' shapes and function must match the checkpoint's (a changed rank would
  otherwise read as a damaged checkpoint)."""
  before = saved.get('train', {}).get('lora', {})
  changed = [
    f'train.lora.{k}: checkpoint {before.get(k, "unset")!r}, run {config.train.lora[k]!r}'
    for k in _RESUME_KEYS
    if before.get(k, config_lib.defaults().train.lora[k]) != config.train.lora[k]
  ]
  if changed:
    raise config_lib.ConfigError(
      f'cannot resume {config.output_dir}: {"; ".join(changed)}; set them back or start a new '
      '--config.output_dir.'
    )
