"""`init_from`: start a run from another model, which supplies the architecture and the weights.

The source is a dlmjax run directory (its latest step), a step directory, or a Hugging Face
directory (read through checkpoint/hf_io.py). Model keys the config leaves at their defaults take
the source's values, so `configs/sft.py --config.init_from=PATH` needs no model keys; keys the
config sets keep their values (and the architecture ones must then match the weights). Run-time
knobs (compute dtype, attention backend, remat, scan, loss chunking) stay the config's own.
"""

from __future__ import annotations

import os

import jax

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.model import lora

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
  if hf_io.is_hf_dir(path):
    return hf_io.hf_dir_config(path)[1]
  run_dir, _, _ = checkpoint_lib.resolve_step_dir(path)
  return checkpoint_lib.load_run_config(run_dir)


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


def restore_params(config, setup, purpose: str = 'initialising') -> dict:
  """The source's params in the setup's shardings; the architecture must match the config.
  `purpose` names the use in the printed line (the RL reference model restores them again)."""
  path = hub.resolve(config.init_from)
  if hf_io.is_hf_dir(path):
    _, params = hf_io.load_hf(path, config=config)  # checks the weights against config
    return jax.device_put(params, model_lib.param_placement(config, setup.mesh)[1])
  run_dir, step_dir, _ = checkpoint_lib.resolve_step_dir(path)
  if lora.is_lora_run(checkpoint_lib.load_run_config(run_dir)):
    raise config_lib.ConfigError(
      f'init_from={path!r} is a LoRA run (its checkpoints hold adapters only): export it merged '
      'with python -m dlmjax.convert to-hf and set --config.init_from to that directory.'
    )
  checkpoint_lib.check_architecture(checkpoint_lib.load_run_config(run_dir), config)
  if jax.process_index() == 0:
    print(f'{purpose} from {step_dir}', flush=True)
  shapes, shardings = model_lib.param_placement(config, setup.mesh)
  return checkpoint_lib.restore_params(step_dir, shapes, shardings)
