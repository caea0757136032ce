"""python -m dlmjax.bench --config=configs/pretrain_1p7b.py [--steps N] [--config.x=y ...]

Times the real train step of a config on synthetic tokens and prints one JSON line: tokens/s,
step time, model TFLOP/s per device (FLOPs/token as DESIGN.md counts them), MFU against the
datasheet peak and against a bf16 matmul rate measured here, peak device memory, compile time.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from dlmjax import cli
from dlmjax import config as config_lib
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import reporting
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib

_STEPS = flags.DEFINE_integer('steps', 10, 'timed steps')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'untimed steps after compilation')
_MATMUL = flags.DEFINE_bool('matmul', True, 'measure the bf16 matmul rate for a second MFU')


def measured_matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
  """bf16 [size^2] x [size^2] products per second on device 0, random data (not zeros)."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: a @ b)
  matmul(a, b).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = matmul(a, b)
  out.block_until_ready()
  return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def peak_memory_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if stats is None else stats.get('peak_bytes_in_use')


def run(config, steps: int, warmup: int, matmul: bool) -> dict:
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  stage = stages.build(config)
  step_fn = step_lib.CompiledStep(setup, stage)
  state = setup.init_state(config.seed)
  rng = np.random.default_rng(0)

  def batch():  # the stage's own arrays, random but shaped as the run's
    return {
      k: jax.device_put(v, step_fn.batch_sharding) for k, v in stage.example_batch(rng).items()
    }

  start = time.perf_counter()
  state, metrics = step_fn(state, batch())
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    state, metrics = step_fn(state, batch())
  jax.block_until_ready(metrics)
  batches = [batch() for _ in range(steps)]
  start = time.perf_counter()
  for b in batches:
    state, metrics = step_fn(state, b)
  jax.block_until_ready((state, metrics))
  step_s = (time.perf_counter() - start) / steps

  devices = jax.device_count()
  tokens_per_s = config.train.global_batch_size * config.model.seq_len / step_s
  flops_per_token = setup.model_config.flops_per_token(config_lib.attention_streams(config))
  model_tflops = tokens_per_s * flops_per_token / devices / 1e12
  kind = jax.devices()[0].device_kind
  datasheet = reporting.peak_flops_per_device(0.0) / 1e12  # 0 for a kind not in the table
  result = dict(
    layers=config.model.num_layers,
    d_model=config.model.d_model,
    device=kind,
    devices=devices,
    mesh=dict(config.mesh),
    micro_batch=config.train.micro_batch_size,
    global_batch=config.train.global_batch_size,
    seq=config.model.seq_len,
    dtype=config.model.dtype,
    matmul_dtype=config.model.matmul_dtype,
    remat=config.model.remat,
    attention=config.model.attention_backend,
    params=setup.model_config.num_params(),
    tokens_per_s=round(tokens_per_s),
    step_time_s=round(step_s, 4),
    model_tflops_per_device=round(model_tflops, 1),
    compile_s=round(compile_s, 1),
    loss=float(metrics['loss']),
  )
  if datasheet:
    result['mfu_datasheet'] = round(model_tflops / datasheet, 4)
  if matmul and jax.devices()[0].platform == 'gpu':
    rate = measured_matmul_tflops()
    result['matmul_tflops'] = round(rate, 1)
    result['mfu_measured_matmul'] = round(model_tflops / rate, 4)
  peak = peak_memory_bytes()
  if peak is not None:
    result['peak_mem_gib'] = round(peak / 2**30, 1)
  return result


def main(argv, config):
  del argv
  print(json.dumps(run(config, _STEPS.value, _WARMUP.value, _MATMUL.value)), flush=True)


if __name__ == '__main__':
  cli.run(main, config_file='configs/pretrain_1p7b.py')
