"""The configuration: every key and its default (schema), old keys' replacements (migration),
config files and overrides (loading), values computed from the keys (derived) and validation,
which each feature registers beside its own code (registry).

Callers import this package (`from dlmjax import config as config_lib`); the names below are
its public API.
"""

from dlmjax.config.derived import (
  MESH_AXES,
  ROPE_SCALING_FIELDS,
  batch_parallelism,
  dense_layer_indices,
  dense_layers,
  fit_schedule,
  format_rope_scaling,
  log_outputs,
  lora_targets,
  model_field,
  mesh_size,
  num_microbatches,
  padded_vocab_size,
  parse_rope_scaling,
  pipeline_microbatches,
  projection_widths,
  ramp_steps,
  resolve_mesh,
  set_model_fields,
)
from dlmjax.config.errors import ConfigError, UserError
from dlmjax.config.keys import get_key
from dlmjax.config.loading import (
  PRESET_OVERRIDE,
  apply_overrides,
  check_keys,
  load_file,
  parse_command_line,
)
from dlmjax.config.migration import REMOVED, RENAMED, from_dict, old_key_message
from dlmjax.config.presets import PRESETS, apply_preset
from dlmjax.config.registry import fit_to_devices, registered_choices, validate, validate_early
from dlmjax.config.stages import StageTraits, attention_streams, stage_traits
from dlmjax.config.schema import (
  ARCHITECTURE_KEYS,
  EVAL_SEED,
  MODEL_FIELD_KEYS,
  STREAM_KEYS,
  VOCAB_MULTIPLE,
  defaults,
)

__all__ = [
  'ARCHITECTURE_KEYS',
  'ConfigError',
  'EVAL_SEED',
  'MESH_AXES',
  'MODEL_FIELD_KEYS',
  'PRESET_OVERRIDE',
  'PRESETS',
  'REMOVED',
  'RENAMED',
  'ROPE_SCALING_FIELDS',
  'STREAM_KEYS',
  'StageTraits',
  'UserError',
  'VOCAB_MULTIPLE',
  'apply_overrides',
  'apply_preset',
  'attention_streams',
  'batch_parallelism',
  'check_keys',
  'defaults',
  'dense_layer_indices',
  'dense_layers',
  'fit_schedule',
  'fit_to_devices',
  'format_rope_scaling',
  'from_dict',
  'get_key',
  'load_file',
  'log_outputs',
  'lora_targets',
  'mesh_size',
  'model_field',
  'num_microbatches',
  'old_key_message',
  'padded_vocab_size',
  'parse_command_line',
  'parse_rope_scaling',
  'pipeline_microbatches',
  'projection_widths',
  'ramp_steps',
  'registered_choices',
  'resolve_mesh',
  'set_model_fields',
  'stage_traits',
  'validate',
  'validate_early',
]
