"""python -m dlmjax.summary --config=configs/X.py: size, FLOPs and memory per device of a config.

Nothing is allocated: the counts are exact arithmetic on the config and the memory figure is an
estimate (params, gradients, Adam moments, saved activations, logits) for the configured mesh.
`--compile` additionally compiles the real train step on the present devices and prints XLA's
own memory analysis.
"""

from __future__ import annotations

from dlmjax import cli

CONFIG_FILE = 'configs/tiny.py'  # without --config
if __name__ == '__main__':  # a config error in about a second, before jax and the model load
  cli.check_command_line(CONFIG_FILE, source_required=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from dlmjax import config as config_lib  # noqa: E402
from dlmjax import model as model_lib  # noqa: E402
from dlmjax.checkpoint import init_from as init_from_lib  # noqa: E402
from dlmjax.checkpoint import run_dir as run_dir_lib  # noqa: E402
from dlmjax.model import lora  # noqa: E402
from dlmjax.parallel import mesh as mesh_lib  # noqa: E402
from dlmjax.parallel import pipeline  # noqa: E402
from dlmjax.train import memory  # noqa: E402
from dlmjax.train import stages  # noqa: E402
from dlmjax.train import state as state_lib  # noqa: E402
from dlmjax.train import step as step_lib  # noqa: E402

_DEVICES = flags.DEFINE_integer(
  'devices', 0, 'validate the mesh for this many devices (default: the devices present)'
)
_COMPILE = flags.DEFINE_bool('compile', False, 'compile the step and print XLA memory analysis')
_DEVICE_MEMORY = flags.DEFINE_float(
  'device-memory-gib',
  0.0,
  'memory of one GPU in GiB, checked '
  'against the estimate (default: the present GPU, or '
  '--device-kind)',
)
_DEVICE_KIND = flags.DEFINE_string(
  'device-kind',
  '',
  'a GPU kind (H100, H200, B200, ...) whose memory the estimate is checked against',
)

_GIB = 1024**3


def estimate_memory_per_device(config) -> dict:
  """Bytes per device: state, activations, recompute, logits, total (dlmjax.train.memory)."""
  return memory.estimate_bytes_per_device(config)


def _experts_lines(cfg) -> list[str]:
  """An MoE's experts and its active parameters (what FLOPs and MFU count)."""
  if not cfg.num_experts:
    return []
  lines = [
    f'experts: {cfg.num_experts} per {"MoE " if cfg.dense_layers else ""}layer of width '
    f'{cfg.expert_dim}, {cfg.experts_per_token} per token ({cfg.router}) + '
    f'{cfg.shared_experts} shared; {cfg.num_expert_params():,} routed-expert parameters',
    f'active parameters per token: {cfg.num_params(active=True):,} (FLOPs and MFU count these)',
  ]
  if cfg.dense_layers:
    lines.insert(
      1,
      f'dense layers (indices): {",".join(map(str, cfg.dense_layers))} of {cfg.num_layers} '
      f'layers (an MLP of ffn_dim {cfg.ffn_dim}); {cfg.num_moe_layers} MoE layers',
    )
  return lines


def _adopt_init_from(config) -> list[str]:
  """A run with init_from (SFT, RL, LoRA) trains the source's model: its model keys replace the
  ones the config leaves at their defaults, as train does (checkpoint/init_from.py). A source not
  trained yet is said in a line, and the config's own model keys are described."""
  if not config.init_from:
    return []
  try:
    adopted = init_from_lib.adopt_source_config(config)
  except (config_lib.ConfigError, run_dir_lib.CheckpointError) as e:
    return [f"model: the config's own keys, not init_from's ({e})"]
  changed = f' ({", ".join(adopted)})' if adopted else ''
  return [f'model: the one init_from {config.init_from} holds{changed}']


def summarize(config, num_devices: int | None) -> str:
  if num_devices is None:
    num_devices = jax.device_count()
  source_lines = _adopt_init_from(config)
  schedule_note = config_lib.fit_schedule(config)
  config_lib.fit_to_devices(config, num_devices)
  cfg = model_lib.ModelConfig.from_config(config)
  unpadded = cfg.num_params() - (cfg.vocab_size - config.model.vocab_size) * cfg.d_model * (
    1 if cfg.tie_embeddings else 2
  )
  memory = estimate_memory_per_device(config)
  m = config.mesh
  tokens_per_step = config.train.global_batch_size * cfg.seq_len
  embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  streams = config_lib.attention_streams(config)
  flops = cfg.flops_per_token(streams)
  doubled = ', the layers on [x_t || x_0] (2 x seq_len)' if streams == 2 else ''
  lines = [
    *source_lines,
    f'parameters: {cfg.num_params():,} with the embedding padded to {cfg.vocab_size} rows '
    f'(the count used everywhere); {unpadded:,} with the tokenizer vocab '
    f'{config.model.vocab_size}',
    f'non-embedding parameters: {cfg.num_params() - embedding:,}',
    *_experts_lines(cfg),
    f'FLOPs per token (train): {flops:.4e}; per step: '
    f'{flops * tokens_per_step:.4e} ({tokens_per_step:,} tokens{doubled})',
    f'mesh: data {m.data} x fsdp {m.fsdp} x expert {m.expert} x tensor {m.tensor} x '
    f'pipeline {m.pipeline} x '
    f'context {m.context}; {config_lib.num_microbatches(config)} micro-batches of '
    f'{config.train.micro_batch_size} rows per step',
    _pipeline_line(config),
    *_lora_lines(config, cfg),
    f'memory per device (estimate): {memory["total"] / _GIB:.2f} GiB = state '
    f'{memory["state"] / _GIB:.2f} + activations {memory["activations"] / _GIB:.2f} + '
    f'recompute {memory["recompute"] / _GIB:.2f} + logits {memory["logits"] / _GIB:.2f} '
    f'(remat {cfg.remat}, {cfg.dtype})',
  ]
  if schedule_note:
    lines.append(schedule_note)
  return '\n'.join(lines)


def _lora_lines(config, cfg) -> list[str]:
  """The adapters a LoRA run trains and the base it holds frozen (nothing without LoRA)."""
  t = config.train.lora
  if t.rank <= 0:
    return []
  lora_cfg = lora.with_adapters(cfg, config)
  base = lora.base_bytes(lora_cfg, jnp.dtype(lora.storage_dtype(config)).itemsize)
  return [
    f'LoRA: {lora.num_adapter_params(lora_cfg):,} trainable adapter parameters (rank {t.rank}, '
    f'alpha {t.alpha:g}, targets {t.targets}); frozen base {base / _GIB:.2f} GiB in '
    f'{t.base_dtype}, no gradient or optimizer state'
  ]


def _pipeline_line(config) -> str:
  """The schedule and its idle share (pipeline/bubble_fraction), or that there is none."""
  m = config.mesh
  if m.pipeline == 1:
    return 'pipeline: off (bubble fraction 0)'
  micro = config_lib.pipeline_microbatches(config)
  kind = 'GPipe' if m.pipeline_repeats == 1 else f'circular, {m.pipeline_repeats} repeats'
  bubble = pipeline.bubble_fraction(m.pipeline, m.pipeline_repeats, micro)
  return (
    f'pipeline: {m.pipeline} stages ({kind}) x {micro} micro-batches of '
    f'{config.train.micro_batch_size // micro} rows, '
    f'{config.model.num_layers // (m.pipeline * m.pipeline_repeats)} layers per stage and '
    f'repeat; bubble fraction {bubble:.3f}'
  )


def compiled_memory(config) -> str:
  """XLA's memory analysis of the real step on the present devices."""
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  stage = stages.build(config)
  step_fn = step_lib.CompiledStep(setup, stage)
  example = stage.example_batch(np.random.default_rng(0))
  batch = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=step_fn.batch_sharding)
    for k, v in example.items()
  }
  analysis = step_fn.lower(batch).compile().memory_analysis()
  if analysis is None:
    return 'compiled memory: not reported by this backend'
  temp = analysis.temp_size_in_bytes / _GIB
  args = analysis.argument_size_in_bytes / _GIB
  return f'compiled memory per device: arguments {args:.2f} GiB + temporaries {temp:.2f} GiB'


def check_memory(config, device_memory_gib: float, device_kind: str) -> str:
  """The fail-fast check `train` runs at start, against a named GPU; ConfigError if too big."""
  if device_memory_gib > 0:
    capacity, what = device_memory_gib * _GIB * memory.usable_fraction(), f'{device_memory_gib} GiB'
  elif device_kind:
    capacity, what = memory.device_memory_bytes(device_kind), device_kind
    if capacity is None:
      raise config_lib.ConfigError(
        f'--device-kind={device_kind} is not a known GPU ('
        f'{", ".join(n for n, _ in memory.DEVICE_MEMORY_GIB)}); pass '
        '--device-memory-gib instead.'
      )
  else:
    capacity, what = memory.present_device_memory_bytes(), 'the present device'
  if capacity is None:
    return 'memory check: skipped (no GPU here; pass --device-memory-gib=G or --device-kind=H200)'
  estimate = memory.check_fits(config, capacity)
  return (
    f'memory check: fits, {estimate["total"] / _GIB:.1f} of {capacity / _GIB:.1f} GiB usable '
    f'on {what} (XLA_PYTHON_CLIENT_MEM_FRACTION {memory.usable_fraction():g})'
  )


def main(argv, config):
  del argv
  print(summarize(config, _DEVICES.value or None))
  print(check_memory(config, _DEVICE_MEMORY.value, _DEVICE_KIND.value))
  if _COMPILE.value:
    print(compiled_memory(config))


if __name__ == '__main__':
  cli.run(main, config_file=CONFIG_FILE)
