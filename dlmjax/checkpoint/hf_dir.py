"""A Hugging Face model directory read from its files alone: whether a path is one, and the
dlmjax config it describes (config.json through its family, or the exporter's dlmjax config).

No JAX or numpy here, so a command line adopts an init_from source's model keys and checks the
run's config before its heavy imports (config.validate_early); reading the weights is
checkpoint/hf_io.py's.
"""

from __future__ import annotations

import json
import os

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import run_dir

# transformers' names of the weights: one file, or shards listed by an index.
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory: safetensors weights and no dlmjax checkpoints/."""
  return (
    os.path.isdir(path)
    and not os.path.isdir(os.path.join(path, run_dir.CHECKPOINT_DIR))
    and any(os.path.exists(os.path.join(path, n)) for n in (SINGLE_FILE, INDEX_FILE))
  )


def resolve_config(hf: dict, config, saved_json: str | None, missing_qk_norm: str = 'error'):
  """The config of an import: --config (checked against the weights), else the exporter's
  dlmjax config, else one derived from the Hugging Face config (a family without QK-norm into a
  QK-norm model when missing_qk_norm='ones')."""
  if config is not None:
    hf_config.check_matches(hf, config, missing_qk_norm=missing_qk_norm)
    return config
  base = None
  if saved_json is not None:
    base = config_lib.from_dict(json.loads(saved_json))
  config = hf_config.config_from_hf(hf, base)
  if missing_qk_norm == 'ones':
    config.model.qk_norm = True
  return config


def hf_dir_config(hf_dir: str, config=None, *, missing_qk_norm: str = 'error'):
  """The config of a Hugging Face directory (checked against `config` when given): what
  hf_io.load_hf uses, without reading the weights (init_from adopts its model keys)."""
  hf = hf_config.read(hf_dir)
  saved_path = os.path.join(hf_dir, hf_config.DLMJAX_CONFIG_FILE)
  saved_json = None
  if os.path.exists(saved_path):
    with open(saved_path) as f:
      saved_json = f.read()
  given = config is not None
  config = resolve_config(hf, config, saved_json, missing_qk_norm)
  if hf_config.is_sequence_classification(hf):  # a reward model (its score head is read too)
    hf_config.as_reward_model(hf, config, hf_dir, derived=not given)
  if not given and not os.path.exists(config.data.tokenizer):
    shipped = shipped_tokenizer(hf_dir)  # data.tokenizer -> the one beside the weights, if any
    if shipped is not None:
      config.data.tokenizer = shipped
  return hf, config


def shipped_tokenizer(hf_dir: str) -> str | None:
  """The tokenizer in a Hugging Face directory, as data.tokenizer would name it, or None."""
  if os.path.exists(os.path.join(hf_dir, 'tokenizer.json')):
    return os.path.abspath(hf_dir)
  if os.path.exists(os.path.join(hf_dir, 'tokenizer.model')):
    return os.path.abspath(os.path.join(hf_dir, 'tokenizer.model'))
  return None
