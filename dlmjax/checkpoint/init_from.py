"""`init_from`: start a run from another model, which supplies the architecture and the weights.

The source is a dlmjax run directory (its latest step), a step directory, or a Hugging Face
directory (read through checkpoint/hf_io.py); a LoRA run is its merged model, so a run can start
from one (a LoRA run on it gets fresh adapters over the merged weights; rank 0 fine-tunes them).
Model keys the config leaves at their defaults take the source's values, so `configs/sft.py
--config.init_from=PATH` needs no model keys; keys the config sets keep their values (and the
architecture ones must then match the weights). Run-time knobs (compute dtype, attention
backend, remat, scan, loss chunking) stay the config's own.

Only the source's files are read here, without JAX (checkpoint/run_dir.py, hf_dir.py), so a
command line adopts on a copy and checks the whole config before its heavy imports
(config.validate_early); the weights are checkpoint/run_model.py's (source_params).
"""

from __future__ import annotations

import os

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_dir
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import run_dir

RUNTIME_MODEL_KEYS = ('dtype', 'attention_backend', 'remat', 'scan_layers', 'loss_chunk_tokens')
_ADOPTED_DATA_KEYS = ('tokenizer', 'cache_dir')  # where the source's tokenizer lives.


def source_config(path: str):
  """The config the source was trained (or imported) with."""
  path = hub.resolve(path)
  if not os.path.exists(path):
    raise config_lib.ConfigError(
      f'init_from={path!r} does not exist: train the model first (e.g. python -m dlmjax.train '
      '--config=configs/tiny.py writes runs/tiny) or set --config.init_from to a run, step or '
      'Hugging Face directory.'
    )
  if hf_dir.is_hf_dir(path):
    return hf_dir.hf_dir_config(path)[1]
  return run_dir.load_run_config(run_dir.resolve_step_dir(path)[0])


def adopt_source_config(config) -> list[str]:
  """Copies, in place, the source's model keys (and tokenizer) that the config leaves at their
  defaults; returns the adopted keys that changed."""
  saved = source_config(config.init_from)
  defaults = config_lib.defaults()
  changed = []
  groups = [('model', k) for k in defaults.model if k not in RUNTIME_MODEL_KEYS]
  groups += [('data', k) for k in _ADOPTED_DATA_KEYS]
  for group, key in groups:
    current, default, source = config[group][key], defaults[group][key], saved[group][key]
    if current == default and source != current:
      config[group][key] = source
      changed.append(f'{group}.{key}={source!r}')
  return changed
