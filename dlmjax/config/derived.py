"""Values computed from the keys (embedding rows, mesh sizes, schedule fitting, parsed lists):
written once, read by the features and by their checks."""

from __future__ import annotations

import math

from dlmjax.config.errors import ConfigError
from dlmjax.config.schema import MODEL_FIELD_KEYS, VOCAB_MULTIPLE

# model.rope_scaling: each type and the fields its formula reads (transformers' rope_type names).
ROPE_SCALING_FIELDS = {
  'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
  'linear': ('factor',),
}


def parse_rope_scaling(text: str) -> tuple[str, dict] | None:
  """model.rope_scaling 'TYPE:k=v,...' -> (type, {field: float}), or None for ''."""
  if not text:
    return None
  kind, _, rest = text.partition(':')
  fix = "write it as 'TYPE:field=value,...' with TYPE one of " + ', '.join(
    f'{k} ({", ".join(v)})' for k, v in ROPE_SCALING_FIELDS.items()
  )
  if kind not in ROPE_SCALING_FIELDS:
    raise ConfigError(f'model.rope_scaling={text!r}: unknown type {kind!r}; {fix}.')
  fields = {}
  for item in filter(None, rest.split(',')):
    key, _, value = item.partition('=')
    try:
      fields[key.strip()] = float(value)
    except ValueError:
      raise ConfigError(
        f'model.rope_scaling={text!r}: {item!r} is not field=number; {fix}.'
      ) from None
  if sorted(fields) != sorted(ROPE_SCALING_FIELDS[kind]):
    raise ConfigError(
      f'model.rope_scaling={text!r}: {kind} takes exactly {", ".join(ROPE_SCALING_FIELDS[kind])}.'
    )
  if kind == 'llama3' and not fields['high_freq_factor'] > fields['low_freq_factor']:
    raise ConfigError(f'model.rope_scaling={text!r}: high_freq_factor must exceed low_freq_factor.')
  return kind, fields


def format_rope_scaling(kind: str, fields: dict) -> str:
  """The model.rope_scaling string of a type and its fields (the inverse of parse_rope_scaling)."""
  return f'{kind}:' + ','.join(f'{k}={fields[k]:g}' for k in ROPE_SCALING_FIELDS[kind])


def padded_vocab_size(config) -> int:
  """The embedding rows: vocab rounded up to VOCAB_MULTIPLE, independent of the mesh."""
  return int(math.ceil(config.model.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def num_microbatches(config) -> int:
  return config.train.global_batch_size // config.train.micro_batch_size


def batch_parallelism(config) -> int:
  """Devices the batch is split over (data x fsdp x expert)."""
  return config.mesh.data * config.mesh.fsdp * config.mesh.expert


def mesh_size(config) -> int:
  m = config.mesh
  return m.data * m.fsdp * m.expert * m.tensor * m.pipeline * m.context


def pipeline_microbatches(config) -> int:
  """Pipeline micro-batches per train micro-batch (0 in the config = one per stage)."""
  return config.mesh.pipeline_microbatches or config.mesh.pipeline


# The mesh's axes in its order, outermost (slowest links) first (dlmjax/parallel/mesh.py).
MESH_AXES = ('pipeline', 'data', 'fsdp', 'expert', 'context', 'tensor')


def resolve_mesh(config, num_devices: int) -> None:
  """Replaces a -1 mesh axis, in place, by the size that makes the mesh fill num_devices."""
  mesh = config.mesh
  fill = [axis for axis in MESH_AXES if mesh[axis] == -1]
  if len(fill) > 1:
    raise ConfigError(f'mesh axes {fill} are all -1; at most one axis can fill the devices.')
  if not fill:
    return
  others = 1
  for axis in MESH_AXES:
    if axis != fill[0]:
      others *= max(mesh[axis], 1)
  if num_devices % others:
    raise ConfigError(
      f'mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes '
      f'multiply to {others}, which does not divide it.'
    )
  mesh[fill[0]] = num_devices // others


# ----------------------------------------------------------------------------------------------


def log_outputs(config) -> tuple[str, ...]:
  """The names in log.outputs."""
  return tuple(name.strip() for name in config.log.outputs.split(',') if name.strip())


def dense_layers(m) -> tuple[int, ...]:
  """model.moe.dense_layers (of a config.model group) as sorted layer indices ('3,0' -> (0, 3));
  ConfigError if not integers."""
  text = m.moe.dense_layers
  try:
    return tuple(sorted({int(part) for part in text.split(',') if part.strip()}))
  except ValueError:
    raise ConfigError(
      f'model.moe.dense_layers={text!r} is not comma-separated layer indices; set e.g. '
      "--config.model.moe.dense_layers='0,1'."
    ) from None


def dense_layer_indices(
  num_layers: int, *, sparse_step: int = 1, mlp_only=(), first_k_dense: int = 0
) -> str:
  """model.moe.dense_layers of a checkpoint's layer pattern: transformers' Qwen3-MoE makes layer i
  sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; DeepSeek / Ling
  / LLaDA2 keep the first first_k_dense_replace layers dense."""
  if sparse_step < 1:
    raise ConfigError(f'decoder_sparse_step={sparse_step} must be >= 1.')
  dense = [
    i for i in range(num_layers) if i in set(mlp_only) or (i + 1) % sparse_step or i < first_k_dense
  ]
  return ','.join(map(str, dense))


def lora_targets(config) -> tuple[str, ...]:
  """The names in train.lora.targets ('q,k,v' -> ('q', 'k', 'v'))."""
  return tuple(t.strip() for t in config.train.lora.targets.split(',') if t.strip())


def projection_widths(m) -> dict[str, tuple[int, int]]:
  """(input, output) width of each LoRA target's projection (train.lora.targets) of a model
  group or ModelConfig (the same field names)."""
  d, f = m.d_model, m.ffn_dim
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  return dict(q=(d, q), k=(d, kv), v=(d, kv), o=(q, d), gate=(d, f), up=(d, f), down=(f, d))


def ramp_steps(t) -> int:
  """Steps the schedule spends warming up plus, for wsd*, annealing."""
  return t.warmup_steps + (t.wsd_decay_steps if t.schedule.startswith('wsd') else 0)


def fit_schedule(config) -> str | None:
  """Shrinks warmup and anneal in proportion when they do not fit in train.steps (a shortened
  run, e.g. --config.train.steps=5); returns the one info line to print, or None."""
  t = config.train
  ramp = ramp_steps(t)
  if t.steps <= 0 or ramp <= t.steps:
    return None
  wsd = t.schedule.startswith('wsd')
  before = f'warmup {t.warmup_steps}' + (f' + anneal {t.wsd_decay_steps}' if wsd else '')
  t.warmup_steps = t.warmup_steps * t.steps // ramp
  if wsd:
    t.wsd_decay_steps = t.wsd_decay_steps * t.steps // ramp
  after = f'warmup {t.warmup_steps}' + (f' + anneal {t.wsd_decay_steps}' if wsd else '')
  overrides = '--config.train.warmup_steps' + (' / --config.train.wsd_decay_steps' if wsd else '')
  return (
    f'train.steps={t.steps} is shorter than {before} steps: scaled to {after} (set '
    f'{overrides} to choose).'
  )


def set_model_fields(model_group, fields: dict) -> None:
  """Sets model fields named as the model names them (a preset, a Hugging Face checkpoint's
  dims: num_experts, moe_ffn_dim, ...) on a config.model group, each at its key."""
  for name, value in fields.items():
    node, leaf = model_group, MODEL_FIELD_KEYS.get(name, name)
    if '.' in leaf:
      group, leaf = leaf.split('.')
      node = model_group[group]
    node[leaf] = value


def model_field(model_group, name: str):
  """The config.model group's value of a model field (set_model_fields' names)."""
  key = MODEL_FIELD_KEYS.get(name, name)
  node = model_group
  for part in key.split('.'):
    node = node[part]
  return node
