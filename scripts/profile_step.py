"""Profiles 3 steps of the 1.7B train step on one GPU: GPU time per kernel class, per source
line of the model (forward / backward apart) and per kernel.

    MB=8 OUT=/tmp python scripts/profile_step.py [--config.model.remat=...]

Each kernel is traced back to its HLO instruction's metadata (the JAX source line that made it,
and whether it runs under the backward's transpose), so a memory-bound fusion reads as
"layers.py:52 bwd" rather than "loop_multiply_fusion_12" (cuBLAS and cuDNN calls keep "?").
docs/benchmarks.md records its output (1.7B pre-training step, profile of the current step).
Reads the trace with jax.profiler.ProfileData, so it needs no TensorBoard.
"""

import collections
import glob
import os
import re
import sys

import jax
import numpy as np

from dlmjax import config as config_lib
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib

STEPS = 3
CLASSES = (  # (class, substrings of the kernel name), first match wins
  ('collective', ('nccl',)),
  ('attention', ('cudnn', 'fmha', 'flash', 'sdpa')),
  ('norm kernel', ('rms_norm',)),
  ('matmul', ('gemm', 'nvjet', 'cutlass', 'xmma', 'sm90_', 'cublas')),
  ('triton fusion', ('triton',)),
  ('reduction fusion', ('reduce', 'reduction')),
  ('elementwise fusion', ('fusion', 'loop_', 'input_')),
  ('copy', ('memcpy', 'memset', 'copy')),
)


def kernel_class(name: str) -> str:
  lower = name.lower()
  return next((c for c, keys in CLASSES if any(k in lower for k in keys)), 'other')


_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')


def _key(name: str) -> str:
  return re.sub(r'[.\-]', '_', name)


def _tables(hlo_text: str) -> dict:
  """The HLO text's FileNames / FunctionNames / FileLocations / StackFrames tables."""
  tables, current = {}, None
  for line in hlo_text.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      current = tables.setdefault(line, {})
    elif current is not None and re.match(r'^\d+ ', line):
      key, value = line.split(' ', 1)
      current[int(key)] = value
    else:
      current = None
  return tables


def _frame_source(tables: dict, frame_id: int) -> str:
  fields = dict(re.findall(r'(\w+)=(\d+)', tables['StackFrames'][frame_id]))
  loc = dict(re.findall(r'(\w+)=(\d+)', tables['FileLocations'][int(fields['file_location_id'])]))
  file = tables['FileNames'][int(loc['file_name_id'])].strip('"')
  function = tables['FunctionNames'][int(loc['function_name_id'])].strip('"')
  return f'{os.path.basename(file)}:{loc["line"]} {function}'


def hlo_sources(hlo_text: str) -> dict:
  """{instruction (normalised name): 'file:line function fwd|bwd'} from the compiled HLO.

  A fusion takes the metadata of its fused computation's last instruction that has some (the
  fusion's own is often empty); bwd means the op sits under the backward's transpose.
  """
  tables = _tables(hlo_text)
  own, last_in, calls, computation = {}, {}, {}, None
  for line in hlo_text.splitlines():
    comp = _COMPUTATION.match(line)
    if comp:
      computation = comp.group(1)
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name = match.group(2)
    called = re.search(r'calls=%?([\w.\-]+)', line)
    if called:
      calls[name] = called.group(1)
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r'stack_frame_id=(\d+)', line)
    if op_name:
      where = '?'
      if frame and 'StackFrames' in tables:
        where = _frame_source(tables, int(frame.group(1)))
      direction = 'bwd' if 'transpose(' in op_name.group(1) else 'fwd'
      own[name] = f'{where} {direction}'
      if where != '?' or computation not in last_in:  # prefer an instruction with a source line
        last_in[computation] = own[name]
  sources = {}
  for name in set(own) | set(calls):
    mine, fused = own.get(name, '?'), last_in.get(calls.get(name))
    sources[_key(name)] = fused if mine.startswith('?') and fused else mine
  return sources


def fused_computation_text(hlo_text: str, instruction: str) -> str:
  """The body of the computation a (normalised) fusion instruction calls, for reading."""
  called = None
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and _key(match.group(2)) == instruction:
      found = re.search(r'calls=%?([\w.\-]+)', line)
      called = found and found.group(1)
      break
  if not called:
    return ''
  start = re.search(rf'^%?{re.escape(called)} \(.*$', hlo_text, re.M)
  if not start:
    return ''
  end = hlo_text.find('\n}', start.start())
  body = hlo_text[start.start() : end]
  return '\n'.join(re.sub(r', metadata=\{.*\}', '', line)[:200] for line in body.splitlines())


def _hlo_op(event) -> str:
  for name, value in event.stats:
    if name == 'hlo_op':
      return str(value)
  return event.name


def main():
  config = config_lib.load_file(os.environ.get('CONFIG', 'configs/pretrain_1p7b.py'))
  config.train.micro_batch_size = config.train.global_batch_size = int(os.environ.get('MB', 8))
  config_lib.apply_overrides(config, sys.argv[1:])  # --config.a.b=value, as the benchmark
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  stage = stages.build(config)
  step_fn = step_lib.CompiledStep(setup, stage)
  state = setup.init_state(0)
  rng = np.random.default_rng(0)

  def batch():  # the stage's own arrays, random but shaped as the run's
    return {
      k: jax.device_put(v, step_fn.batch_sharding) for k, v in stage.example_batch(rng).items()
    }

  compiled = step_fn.compile(state, batch())  # the very executable the trace then shows
  hlo_text = compiled.as_text()
  sources = hlo_sources(hlo_text)
  for _ in range(3):
    state, metrics = compiled(state, batch())
  jax.block_until_ready(metrics)
  out = os.path.join(os.environ.get('OUT', '/tmp'), 'trace')
  with jax.profiler.trace(out):
    for _ in range(STEPS):
      state, metrics = compiled(state, batch())
    jax.block_until_ready((state, metrics))
  profile = jax.profiler.ProfileData.from_file(
    glob.glob(f'{out}/**/*.xplane.pb', recursive=True)[0]
  )
  plane = next((p for p in profile.planes if 'GPU:0' in p.name), None)
  if plane is None:
    raise SystemExit(f'no GPU:0 plane in the trace (planes: {[p.name for p in profile.planes]})')
  by_kernel, by_class, by_source, calls = (collections.Counter() for _ in range(4))
  for line in plane.lines:
    if line.name.startswith('Stream'):
      for event in line.events:
        ms = event.duration_ns / 1e6 / STEPS
        cls = kernel_class(event.name)
        # Under CUDA graphs hlo_op names the command buffer; the kernel name is the fusion's.
        source = sources.get(_key(_hlo_op(event))) or sources.get(_key(event.name), '?')
        by_kernel[f'{event.name[:80]}  [{source}]'] += ms
        calls[f'{event.name[:80]}  [{source}]'] += 1 / STEPS
        by_class[cls] += ms
        by_source[f'{cls:18s} {source}'] += ms
  total = sum(by_class.values())
  print(f'GPU busy per step: {total:.1f} ms')
  for name, ms in by_class.most_common():
    print(f'  {name:24s} {ms:8.1f} ms  {100 * ms / total:5.1f}%')
  print('by kernel class and source line (fwd / bwd):')
  for name, ms in by_source.most_common(45):
    print(f'    {ms:7.2f} ms  {name}')
  print('by kernel (ms per step, calls per step, mean ms per call):')
  for name, ms in by_kernel.most_common(30):
    print(f'    {ms:7.2f} ms  {calls[name]:5.0f} x {ms / calls[name]:.3f}  {name}')
  print('the largest fusions, as HLO:')
  fusions = [(ms, n) for n, ms in by_kernel.items() if 'fusion' in n and 'gemm' not in n]
  gemms = [(ms, n) for n, ms in by_kernel.items() if n.startswith('gemm_fusion')]
  for ms, name in sorted(gemms, reverse=True)[:1] + sorted(fusions, reverse=True)[:4]:
    print(f'--- {ms:.2f} ms {name}')
    print(fused_computation_text(hlo_text, _key(name.split()[0]))[:2500])


if __name__ == '__main__':
  main()
