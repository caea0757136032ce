"""Profiles the sampler's decode on one GPU: GPU time per step by kernel class, and its bound.

    python scripts/profile_decode.py --preset llada_8b --batches 1,16 --modes dual,none \
        [--param-dtype float32|bfloat16] [--layer-loop scan|unrolled] [--steps-per-token 1]
    python scripts/profile_decode.py --preset llada_8b --param-dtype bfloat16 --forward 16x512
    python scripts/profile_decode.py --preset llada2_mini --modes block --batches 1 --gen 128 \
        --param-dtype bfloat16 --experts both [--block-experts 48]

Random weights at the preset's shape, bf16 compute, a 64-token prompt, gen 256, block 32. Each
(batch, mode) decode is compiled ahead, run once untimed, then timed and traced once; the trace's
GPU kernels are summed by class (matmul, attention, copies, elementwise and reduction fusions,
...) and divided by the number of sampler steps, and the host-side gap (wall time minus GPU busy
time) is reported beside them. The bound of a step: the larger of the weight bytes it must read
(an MoE layer: only the experts its tokens route to, read_bytes) over memory bandwidth (4.8 TB/s
on an H200, 3.35 on an H100) and the step's matmul FLOPs over bf16 peak (about 790 TFLOP/s).
docs/benchmarks.md, Sampler, "where a decode step's time goes", records its output. Reads the
trace with jax.profiler.ProfileData (no TensorBoard).
"""

import argparse
import collections
import functools
import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_step  # noqa: E402  (the kernel classes and the HLO source map)

from dlmjax import config as config_lib  # noqa: E402
from dlmjax import model as model_lib  # noqa: E402
from dlmjax.diffusion import sampler_programs, sampling_config  # noqa: E402
from dlmjax.model import presets  # noqa: E402

# Memory bandwidth by device kind (H200: 4.8 TB/s, H100 80GB HBM3: 3.35 TB/s, the datasheets)
# and the bf16 matmul rate measured on an H200 (the H100's chip is the same).
BANDWIDTHS, PEAK = {'H100': 3.35e12, 'H200': 4.8e12}, 790e12


def bandwidth() -> float:
  kind = jax.devices()[0].device_kind
  return next((bw for name, bw in BANDWIDTHS.items() if name in kind), BANDWIDTHS['H200'])


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--preset', default='llada_8b')
  p.add_argument('--batches', default='1,16')
  p.add_argument('--modes', default='dual,none')
  p.add_argument('--gen', type=int, default=256)
  p.add_argument('--prompt', type=int, default=64)
  p.add_argument('--block', type=int, default=32)
  p.add_argument('--tokens-per-step', type=int, default=1)
  p.add_argument('--param-dtype', default='float32', choices=('float32', 'bfloat16'))
  p.add_argument('--layer-loop', default='scan', choices=('scan', 'unrolled'))
  p.add_argument(
    '--experts',
    default='in_place',
    choices=('in_place', 'sliced', 'both'),
    help="an MoE's routed experts read in place from their stacks (the sampler's default), or "
    'cut per layer (the old path: the Pallas grouped matmul copies each layer), or both, each '
    'its own row',
  )
  p.add_argument(
    '--gmm-fwd-tile',
    default='',
    help='probe: the Pallas grouped matmul forward tile BMxBNxBK[xWARPS[xSTAGES]] (default '
    '128x256x64x8x3); at batch-1 decode its 256 rows x 512 columns make only 4 programs',
  )
  p.add_argument(
    '--block-experts', type=int, default=0, help='model.moe.block_experts (LLaDA2.2 block routing)'
  )
  p.add_argument(
    '--scan-unroll', type=int, default=1, help='probe: the layer scan unrolled by this factor'
  )
  p.add_argument(
    '--forward',
    default='',
    help='BxL: profile one forward of B rows of L tokens instead (the inference program: fused '
    'layout made once, decode compiler options, bf16 logits), e.g. 16x512 (benchmarks.family_8b)',
  )
  p.add_argument('--label', default='')
  p.add_argument('--no-trace', action='store_true')
  p.add_argument('--tiny', action='store_true', help='a CPU-sized check of the script')
  return p.parse_args(argv)


def unroll_layer_scan(factor):
  """Probe only: the transformer's layer scan (its one lax.scan) with unroll=factor."""
  from dlmjax.model import transformer  # pylint: disable=import-outside-toplevel

  class Lax:
    scan = staticmethod(functools.partial(jax.lax.scan, unroll=factor))

    def __getattr__(self, name):
      return getattr(jax.lax, name)

  class Jax:
    lax = Lax()

    def __getattr__(self, name):
      return getattr(jax, name)

  transformer.jax = Jax()


def set_gmm_forward_tile(spec):
  """Probe only: every Pallas grouped matmul forward with this tile (kernels.grouped_matmul
  calls the module's function, so the partial reaches the model's experts)."""
  from dlmjax.kernels import grouped_matmul_pallas as gmp  # pylint: disable=import-outside-toplevel

  tiles = gmp.Tiles(fwd=gmp.Tile(*(int(n) for n in spec.lower().split('x'))))
  gmp.grouped_matmul = functools.partial(gmp.grouped_matmul, tiles=tiles)


def build(args):
  config = config_lib.load_file('configs/pretrain_1p7b.py')
  config_lib.apply_overrides(config, [f'model.preset={args.preset}'], presets.PRESETS)
  config.model.dtype = 'bfloat16'
  config.model.remat = 'none'
  config.model.scan_layers = args.layer_loop == 'scan'
  config.model.moe.block_experts = args.block_experts
  if args.tiny:
    m = config.model
    m.num_layers, m.d_model, m.ffn_dim = 3, 64, 128
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 4, 16
    m.vocab_size, m.mask_token_id, m.eos_token_id, m.pad_token_id = 512, 3, 2, 0
    m.moe.num_experts, m.moe.ffn_dim = min(m.moe.num_experts, 16), min(m.moe.ffn_dim, 32)
  if jax.default_backend() != 'gpu':
    config.model.attention_backend, config.model.norm_backend = 'xla', 'xla'
  elif config.model.attention_backend == 'cudnn':
    config.model.attention_backend = 'auto'
  return config, model_lib.ModelConfig.from_config(config)


ROUTED = ('gate_proj', 'up_proj', 'down_proj')  # an MoE layer's routed experts (model/moe.py)


def read_bytes(model_config, params, batch, tokens):
  """Weight bytes a forward of `tokens` rows per sequence must read: every weight but the
  embedding table, except that an MoE layer reads only the experts its batch x tokens routed
  tokens choose. With uniform routing (random weights route about so) T tokens choosing k of E
  touch E (1 - (1 - k / E)^T) experts (163 of 256 for LLaDA2.0-mini's 32-token block at batch 1;
  153 measured); a block's pool (block_experts C) caps that at C per row's block."""
  c = model_config
  total = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
  total -= c.vocab_size * c.d_model * jax.tree.leaves(params)[0].dtype.itemsize
  if not c.num_experts:
    return total
  e, k, t = c.num_experts, c.experts_per_token, batch * tokens
  touched = e * (1 - (1 - k / e) ** t)
  if c.block_experts:
    touched = min(touched, batch * c.block_experts)
  for key, moe_mlp, *_ in c.layer_runs():
    if moe_mlp:
      routed = sum(params[key]['mlp'][n].nbytes for n in ROUTED)
      total -= routed * (1 - touched / e)
  return total


def step_flops(model_config, params, batch, tokens, context):
  """Matmul FLOPs of one forward of `tokens` rows per sequence attending to `context` keys."""
  c = model_config
  weights = sum(p.size for p in jax.tree.leaves(params)) - c.vocab_size * c.d_model
  attention = 4 * c.num_layers * c.num_heads * c.head_dim * context
  return batch * tokens * (2 * weights + attention)


def origin(hlo_text, kernel):
  """The op_name and source line XLA recorded for the fusion a kernel is named after, if any."""
  name = kernel.split('(')[0].strip()
  for line in hlo_text.splitlines():
    stripped = line.strip().removeprefix('ROOT ')
    if stripped.startswith(f'%{name} ') or stripped.startswith(f'{name} '):
      meta = line.split('metadata={')[-1] if 'metadata={' in line else ''
      return meta[:160].rstrip('}')
  return ''


def trace_classes(run, steps):
  out = tempfile.mkdtemp()
  with jax.profiler.trace(out):
    jax.block_until_ready(run())
  profile = jax.profiler.ProfileData.from_file(
    glob.glob(f'{out}/**/*.xplane.pb', recursive=True)[0]
  )
  plane = next(p for p in profile.planes if 'GPU:0' in p.name)
  by_class, by_kernel, calls = collections.Counter(), collections.Counter(), collections.Counter()
  first, last = None, None
  for line in plane.lines:
    if not line.name.startswith('Stream'):
      continue
    for event in line.events:
      ms = event.duration_ns / 1e6 / steps
      by_class[profile_step.kernel_class(event.name)] += ms
      by_kernel[event.name[:90]] += ms
      calls[event.name[:90]] += 1 / steps
      start, end = event.start_ns, event.start_ns + event.duration_ns
      first = start if first is None else min(first, start)
      last = end if last is None else max(last, end)
  span = (last - first) / 1e6 / steps if first is not None else 0.0
  return by_class, by_kernel, calls, span


def profile_forward(args, model_config, params) -> int:
  """One forward of B x L tokens as an inference program, timed and split by kernel class."""
  from dlmjax.model import programs  # pylint: disable=import-outside-toplevel

  batch, length = (int(n) for n in args.forward.lower().split('x'))
  fused_config = model_lib.inference_config(model_config)
  fused = jax.jit(lambda p: model_lib.computed_params(model_config, p))(params)
  forward = programs.jit_program(
    lambda p, t: model_lib.merge(fused_config, p)(t, logits_dtype=jnp.bfloat16),
    model_config.matmul_dtype,
    decode=True,
  )
  tokens = np.random.default_rng(0).integers(10, 1000, (batch, length)).astype(np.int32)
  compiled = forward.lower(fused, tokens).compile()
  jax.block_until_ready(compiled(fused, tokens))
  walls = []
  for _ in range(5):  # the best of five, as benchmarks.family_8b keeps its best
    start = time.perf_counter()
    jax.block_until_ready(compiled(fused, tokens))
    walls.append((time.perf_counter() - start) * 1e3)
  wall = min(walls)
  flops = step_flops(model_config, params, batch, length, length)
  row = dict(forward=args.forward, ms=round(wall, 2), tok_s=round(batch * length / wall * 1e3))
  row['ms_each'] = [round(w, 1) for w in walls]
  row['pct_peak'] = round(100 * flops / PEAK / wall * 1e3, 1)
  if not args.no_trace:
    by_class, by_kernel, calls, span = trace_classes(lambda: compiled(fused, tokens), 1)
    row['gaps_ms'] = round(max(span - sum(by_class.values()), 0.0), 2)
    row['classes'] = {k: round(v, 2) for k, v in by_class.most_common()}
    hlo = compiled.as_text()
    for name, ms in by_kernel.most_common(14):
      print(f'  {ms:8.3f} {calls[name]:7.1f}x  {name}  <- {origin(hlo, name)}')
  print(json.dumps(row), flush=True)
  return 0


def main(argv=None):
  args = parse(argv)
  config, model_config = build(args)
  if args.scan_unroll > 1:
    unroll_layer_scan(args.scan_unroll)
  if args.gmm_fwd_tile:
    set_gmm_forward_tile(args.gmm_fwd_tile)
  m = config.model
  dtype = jnp.bfloat16 if args.param_dtype == 'bfloat16' else jnp.float32
  # One program: a float32 copy of the LLaDA2-mini's 16B weights alone would fill an 80 GB card.
  params = jax.jit(
    lambda k: jax.tree.map(lambda a: a.astype(dtype), model_lib.init_params(model_config, k))
  )(jax.random.key(0))
  if args.forward:
    return profile_forward(args, model_config, params)
  rng = np.random.default_rng(0)
  rows, outputs = [], {}
  for batch in [int(b) for b in args.batches.split(',')]:
    prompt_BP = rng.integers(10, 1000, (batch, args.prompt)).astype(np.int32)
    lengths_B = np.full(batch, args.prompt, np.int32)
    layouts = ('in_place', 'sliced') if args.experts == 'both' else (args.experts,)
    for mode, layout in [(mode, layout) for mode in args.modes.split(',') for layout in layouts]:
      steps = args.gen // args.tokens_per_step
      sampling = sampling_config.SamplingConfig(
        gen_length=args.gen, steps=steps, block_length=args.block, cache=mode
      )
      fn = sampler_programs.make_generate_fn(
        model_config,
        sampling,
        mask_id=m.mask_token_id,
        eos_id=m.eos_token_id,
        pad_id=m.pad_token_id,
        vocab_size=m.vocab_size,
        experts_in_place=layout == 'in_place',
      )
      t = time.perf_counter()
      compiled = fn.lower(params, prompt_BP, lengths_B, jax.random.key(0)).compile()
      compile_s = time.perf_counter() - t
      jax.block_until_ready(compiled(params, prompt_BP, lengths_B, jax.random.key(0)))
      t = time.perf_counter()
      out = jax.block_until_ready(compiled(params, prompt_BP, lengths_B, jax.random.key(1)))
      wall = (time.perf_counter() - t) / steps * 1e3
      first_tokens = outputs.setdefault((batch, mode), np.asarray(out))
      length = args.prompt + args.gen
      tokens = {'none': length, 'dual': args.block, 'block': args.block, 'prefix': length // 2}
      tokens = tokens.get(mode, length)
      flops = step_flops(model_config, params, batch, tokens, length)
      weight_bytes = read_bytes(model_config, params, batch, tokens)
      bound = max(weight_bytes / bandwidth(), flops / PEAK) * 1e3
      row = dict(
        label=args.label
        or f'{args.param_dtype}/{args.layer_loop}{args.gmm_fwd_tile and "/"}{args.gmm_fwd_tile}',
        experts=f'{layout} (block_experts {args.block_experts})' if m.moe.num_experts else '',
        batch=batch,
        mode=mode,
        k=args.tokens_per_step,
        step_ms=round(wall, 2),
        tok_s=round(batch * args.tokens_per_step / wall * 1e3, 1),
        bound_ms=round(bound, 2),
        pct_bound=round(100 * bound / wall, 1),
        compile_s=round(compile_s, 1),
      )
      if len(layouts) > 1:  # the layouts' greedy tokens (the in-place read changes no value)
        row['tokens_equal_in_place'] = bool(np.array_equal(first_tokens, np.asarray(out)))
      if not args.no_trace:
        by_class, by_kernel, calls, span = trace_classes(
          lambda: compiled(params, prompt_BP, lengths_B, jax.random.key(2)), steps
        )
        busy = sum(by_class.values())
        row['gpu_busy_ms'] = round(busy, 2)
        row['gaps_ms'] = round(max(span - busy, 0.0), 2)
        row['classes'] = {k: round(v, 3) for k, v in by_class.most_common()}
        print(
          f'--- {row["label"]} {row["experts"]} batch {batch} {mode}: top kernels '
          '(ms/step, calls/step)'
        )
        hlo = compiled.as_text()
        for name, ms in by_kernel.most_common(14):
          print(f'  {ms:8.3f} {calls[name]:7.1f}x  {name}  <- {origin(hlo, name)}')
      print(json.dumps(row), flush=True)
      rows.append(row)
  print(
    '| label | experts | batch | mode | k | step ms | tok/s | bound ms | % bound | busy | gaps '
    '| compile s |'
  )
  for r in rows:
    print(
      f'| {r["label"]} | {r["experts"]} | {r["batch"]} | {r["mode"]} | {r["k"]} | {r["step_ms"]} '
      f'| {r["tok_s"]} | '
      f'{r["bound_ms"]} | {r["pct_bound"]} | {r.get("gpu_busy_ms", "-")} | '
      f'{r.get("gaps_ms", "-")} | {r["compile_s"]} |'
    )
  return 0


if __name__ == '__main__':
  sys.exit(main())
