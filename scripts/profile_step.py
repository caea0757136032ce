"""Profiles 3 steps of the 1.7B train step on one GPU and prints GPU time per kernel class.

    MB=8 OUT=/tmp python scripts/profile_step.py

docs/benchmarks.md ("Where the step's time goes") records its output. Reads the trace with
jax.profiler.ProfileData, so it needs no TensorBoard.
"""
import collections
import glob
import os

import jax
import numpy as np

from dlmjax import convert
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib

STEPS = 3
CLASSES = (  # (class, substrings of the kernel name), first match wins
    ('collective', ('nccl',)),
    ('attention (cuDNN)', ('cudnn', 'fmha', 'flash', 'sdpa')),
    ('matmul', ('gemm', 'nvjet', 'cutlass', 'xmma', 'sm90_', 'cublas')),
    ('triton fusion', ('triton',)),
    ('reduction fusion', ('reduce', 'reduction')),
    ('elementwise fusion', ('fusion', 'loop_', 'input_')),
    ('copy', ('memcpy', 'memset', 'copy')),
)


def kernel_class(name: str) -> str:
  lower = name.lower()
  return next((c for c, keys in CLASSES if any(k in lower for k in keys)), 'other')


def main():
  config = convert.load_config_file('configs/pretrain_1p7b.py')
  config.train.micro_batch_size = config.train.global_batch_size = int(os.environ.get('MB', 8))
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  step_fn = step_lib.CompiledStep(setup, stages.STAGES['pretrain'].loss_fn(config))
  state = setup.init_state(0)
  rng = np.random.default_rng(0)
  shape = (config.train.global_batch_size, config.model.seq_len + 1)

  def batch():
    tokens = rng.integers(0, config.model.mask_token_id, shape, dtype=np.int32)
    return {'tokens': jax.device_put(tokens, step_fn.batch_sharding)}

  for _ in range(3):
    state, metrics = step_fn(state, batch())
  jax.block_until_ready(metrics)
  out = os.path.join(os.environ.get('OUT', '/tmp'), 'trace')
  with jax.profiler.trace(out):
    for _ in range(STEPS):
      state, metrics = step_fn(state, batch())
    jax.block_until_ready((state, metrics))
  profile = jax.profiler.ProfileData.from_file(
      glob.glob(f'{out}/**/*.xplane.pb', recursive=True)[0])
  plane = next(p for p in profile.planes if 'GPU:0' in p.name)
  by_kernel, by_class = collections.Counter(), collections.Counter()
  for line in plane.lines:
    if line.name.startswith('Stream'):
      for event in line.events:
        ms = event.duration_ns / 1e6 / STEPS
        by_kernel[event.name[:110]] += ms
        by_class[kernel_class(event.name)] += ms
  total = sum(by_class.values())
  print(f'GPU busy per step: {total:.1f} ms')
  for name, ms in by_class.most_common():
    print(f'  {name:24s} {ms:8.1f} ms  {100 * ms / total:5.1f}%')
  for name, ms in by_kernel.most_common(30):
    print(f'    {ms:7.2f} ms  {name}')


if __name__ == '__main__':
  main()
