"""python -m dlmjax.summary --config=configs/X.py: size, FLOPs and memory per device of a config.

Nothing is allocated: the counts are exact arithmetic on the config and the memory figure is an
estimate (params, gradients, Adam moments, saved activations, logits) for the configured mesh.
`--compile` additionally compiles the real train step on the present devices and prints XLA's
own memory analysis.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from dlmjax import cli
from dlmjax import config as config_lib

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py', 'config file',
                                          lock_config=True)
_DEVICES = flags.DEFINE_integer('devices', 0, 'validate the mesh for this many devices '
                                '(default: the devices present)')
_COMPILE = flags.DEFINE_bool('compile', False, 'compile the step and print XLA memory analysis')

_GIB = 1024 ** 3


def estimate_memory_per_device(config) -> dict:
  """Bytes per device: sharded fp32 params + grads + 2 Adam moments, and activations."""
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  cfg = model_lib.ModelConfig.from_config(config)
  mesh = config.mesh
  shards = mesh.fsdp * mesh.tensor * mesh.pipeline
  state = 16 * cfg.num_params() / shards
  rows = config.train.micro_batch_size // config_lib.batch_parallelism(config)
  act_bytes = 2 if cfg.dtype == 'bfloat16' else 4
  tokens = rows * cfg.seq_len
  width = cfg.d_model / mesh.tensor
  # Per layer, what the backward pass keeps: the layer input only (full remat), the projections
  # (minimal), or everything incl. attention probabilities for xla (none).
  per_token_layer = {'full': cfg.d_model, 'minimal': 4 * width + 3 * cfg.ffn_dim / mesh.tensor,
                     'save_dots': 6 * width + 3 * cfg.ffn_dim / mesh.tensor}.get(
                         cfg.remat, 10 * width + 4 * cfg.ffn_dim / mesh.tensor)
  saved = tokens * per_token_layer * act_bytes * cfg.num_layers
  if cfg.remat == 'none' and cfg.attention_backend == 'xla':
    saved += rows * cfg.num_heads / mesh.tensor * cfg.seq_len ** 2 * 4 * cfg.num_layers
  logits = tokens * cfg.vocab_size / mesh.tensor * 4 * 3  # fp32 logits, softmax and its grad
  return dict(state=state, activations=saved, logits=logits, total=state + saved + logits)


def summarize(config, num_devices: int | None) -> str:
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  if num_devices is None:
    import jax  # pylint: disable=import-outside-toplevel
    num_devices = jax.device_count()
  config_lib.fit_to_devices(config, num_devices)
  cfg = model_lib.ModelConfig.from_config(config)
  unpadded = cfg.num_params() - (cfg.vocab_size - config.model.vocab_size) * cfg.d_model * (
      1 if cfg.tie_embeddings else 2)
  memory = estimate_memory_per_device(config)
  m = config.mesh
  tokens_per_step = config.train.global_batch_size * cfg.seq_len
  embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  lines = [
      f'parameters: {cfg.num_params():,} with the embedding padded to {cfg.vocab_size} rows '
      f'(the count used everywhere); {unpadded:,} with the tokenizer vocab '
      f'{config.model.vocab_size}',
      f'non-embedding parameters: {cfg.num_params() - embedding:,}',
      f'FLOPs per token (train): {cfg.flops_per_token():.4e}; per step: '
      f'{cfg.flops_per_token() * tokens_per_step:.4e} ({tokens_per_step:,} tokens)',
      f'mesh: data {m.data} x fsdp {m.fsdp} x tensor {m.tensor} x pipeline {m.pipeline}; '
      f'{config_lib.num_microbatches(config)} micro-batches of {config.train.micro_batch_size} '
      'rows per step',
      f'memory per device (estimate): {memory["total"] / _GIB:.2f} GiB = state '
      f'{memory["state"] / _GIB:.2f} + activations {memory["activations"] / _GIB:.2f} + logits '
      f'{memory["logits"] / _GIB:.2f} (remat {cfg.remat}, {cfg.dtype})',
  ]
  return '\n'.join(lines)


def compiled_memory(config) -> str:
  """XLA's memory analysis of the real step on the present devices."""
  # pylint: disable=import-outside-toplevel
  import jax
  from dlmjax.parallel import mesh as mesh_lib
  from dlmjax.train import stages
  from dlmjax.train import state as state_lib
  from dlmjax.train import step as step_lib
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  step_fn = step_lib.CompiledStep(setup, stages.STAGES[config.stage].loss_fn(config))
  shape = (config.train.global_batch_size, config.model.seq_len + 1)
  batch = {k: jax.ShapeDtypeStruct(shape, 'int32', sharding=step_fn.batch_sharding)
           for k in step_lib.batch_keys(config)}
  analysis = step_fn.lower(batch).compile().memory_analysis()
  if analysis is None:
    return 'compiled memory: not reported by this backend'
  temp = analysis.temp_size_in_bytes / _GIB
  args = analysis.argument_size_in_bytes / _GIB
  return f'compiled memory per device: arguments {args:.2f} GiB + temporaries {temp:.2f} GiB'


def main(argv):
  del argv
  print(summarize(_CONFIG.value, _DEVICES.value or None))
  if _COMPILE.value:
    print(compiled_memory(_CONFIG.value))


if __name__ == '__main__':
  cli.run(main)
