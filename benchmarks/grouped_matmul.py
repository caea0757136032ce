"""python -m benchmarks.grouped_matmul [--tiny] [--presets ...] [--backends ...] [--tokens 16384]

The MoE experts' grouped matmul (kernels/grouped_matmul.py) at the MoE presets' expert shapes,
one row per backend, projection and preset, and ONE table last:

- shapes: each preset's up projection (gate and up: [M, d_model] x [E, d_model, F]) and down
  projection ([M, F] x [E, F, d_model]); M = --tokens x experts_per_token assignments, sorted
  by expert in uneven groups (a router's shares between 0.5x and 1.5x the mean, expert 1 empty).
- backends: xla (jax.lax.ragged_dot), tokamax (where it imports and traces), pallas (our Triton
  kernels, default tiles: 128 x 256 outputs, 8 warps), pallas_narrow (128 x 128, 4 warps), and
  dense: one [M, K] x [K, N] matmul of the same FLOPs, the rate to aim for.
- each: forward, then forward + backward (both gradients), timed (median ms, TFLOP/s at 2MKN
  forward and 3x that with the backward), its output and both gradients checked against a
  plain reference (every group zero-padded to the largest and run as one batched float32
  einsum, scattered back), relative L2 error (the largest of the three), the compiled
  forward + backward's temporary buffers (XLA's memory analysis) and the device's peak memory
  (jax memory_stats; each row runs in its own process so the peak is that row's own).

Every row is in its own try/except (and process): a failure (an OOM, a kernel that does not
compile, tokamax not importing) prints its error in the row and the others still run.

On one H200 (a few minutes per preset; each row starts its own process):
    python -m benchmarks.grouped_matmul --presets qwen3_30b_a3b --out gmm.jsonl
    python -m benchmarks.grouped_matmul --presets llada_moe_7b_a1b --out gmm.jsonl
On CPU (Pallas in interpret mode, toy widths; 20 rows, about 30 s each on 2 busy cores):
    python -m benchmarks.grouped_matmul --tiny
    python -m benchmarks.grouped_matmul --tiny --presets qwen3_30b_a3b --projections down
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PRESETS = ('qwen3_30b_a3b', 'llada_moe_7b_a1b')
PROJECTIONS = ('up', 'down')
BACKENDS = ('xla', 'tokamax', 'pallas', 'pallas_narrow', 'dense')
_RESULT = 'GROUPED_MATMUL_ROW '


def shape(preset: str, projection: str, tokens: int, tiny: bool):
  """dict(experts, rows, k, n) of one projection of a preset's experts (tiny: toy widths)."""
  from dlmjax.model.presets import PRESETS as ALL  # noqa: PLC0415 - the child process only

  p = ALL[preset]
  experts, width, top_k = p['num_experts'], p['moe_ffn_dim'] or p['ffn_dim'], p['experts_per_token']
  d_model = p['d_model']
  if tiny:  # widths that are no whole tile (padding inside the kernel), a few experts
    experts, width, d_model, top_k = min(experts, 6), 40, 24, 2
  k, n = (d_model, width) if projection == 'up' else (width, d_model)
  return dict(experts=experts, rows=tokens * top_k, k=k, n=n)


def _group_sizes(experts: int, rows: int):
  """Uneven group sizes summing to rows: shares uniform in [0.5, 1.5] x the mean, expert 1 empty."""
  import numpy as np  # noqa: PLC0415

  share = np.random.default_rng(0).uniform(0.5, 1.5, experts)
  if experts > 1:
    share[1] = 0.0
  counts = np.floor(share / share.sum() * rows).astype(np.int32)
  counts[0] += rows - counts.sum()
  return counts


def _reference(lhs, rhs, sizes, cot):
  """(out, d lhs, d rhs) in float32: every group zero-padded to the largest, one batched einsum
  each (row `rows`, appended zeros, is the padding), scattered back by row."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  rows = lhs.shape[0]
  starts = np.cumsum(sizes) - sizes
  capacity = max(int(sizes.max()), 1)
  slot = np.arange(capacity)[None, :]
  index_GC = np.where(slot < sizes[:, None], starts[:, None] + slot, rows).astype(np.int32)
  hi = jax.lax.Precision.HIGHEST

  @jax.jit
  def run(lhs, rhs, cot):
    pad = lambda x: jnp.concatenate([x.astype(jnp.float32), jnp.zeros((1, x.shape[1]))])[index_GC]  # noqa: E731
    lhs_GCK, cot_GCN, rhs_GKN = pad(lhs), pad(cot), rhs.astype(jnp.float32)
    out_GCN = jnp.einsum('gck,gkn->gcn', lhs_GCK, rhs_GKN, precision=hi)
    dlhs_GCK = jnp.einsum('gcn,gkn->gck', cot_GCN, rhs_GKN, precision=hi)
    drhs_GKN = jnp.einsum('gck,gcn->gkn', lhs_GCK, cot_GCN, precision=hi)
    out = jnp.zeros((rows + 1, out_GCN.shape[-1])).at[index_GC].set(out_GCN)[:rows]
    dlhs = jnp.zeros((rows + 1, lhs.shape[1])).at[index_GC].set(dlhs_GCK)[:rows]
    return out, dlhs, drhs_GKN

  return run(lhs, rhs, cot)


def _function(backend: str):
  """fn(lhs, rhs, sizes) of one backend."""
  from dlmjax.kernels import grouped_matmul as gmm  # noqa: PLC0415
  from dlmjax.kernels import grouped_matmul_pallas as pallas  # noqa: PLC0415

  if backend == 'dense':  # measure() hands it one [K, N] matrix
    return lambda a, b, s: a @ b
  if backend == 'pallas_narrow':  # the tiles before the measured default
    narrow = pallas.Tile(128, 128, 64, 4, 4)
    tiles = pallas.Tiles(fwd=narrow, dlhs=narrow, drhs=pallas.Tile(64, 128, 128, 4, 3))
    return lambda a, b, s: pallas.grouped_matmul(a, b, s, tiles=tiles)
  if backend == 'tokamax' and not gmm.tokamax_available():
    raise RuntimeError('tokamax does not import here (pip install ".[moe]")')
  return lambda a, b, s: gmm.grouped_matmul(a, b, s, backend=backend)


def _error_line(e: BaseException) -> str:
  return f'{type(e).__name__}: {str(e).strip().splitlines()[0][:150] if str(e).strip() else ""}'


def measure(preset, projection, backend, *, tokens, tiny, iters, dtype):
  """One row: this process's device runs one backend at one shape."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from benchmarks import timing  # noqa: PLC0415

  dims = shape(preset, projection, tokens, tiny)
  e, m, k, n = dims['experts'], dims['rows'], dims['k'], dims['n']
  row = dict(preset=preset, projection=projection, backend=backend, **dims, errors=[])
  row['device'] = jax.devices()[0].device_kind
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(dtype)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  cot = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
  sizes_np = _group_sizes(e, m)
  sizes = jnp.asarray(sizes_np)
  flops = 2 * m * k * n

  def peak_gib():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get('peak_bytes_in_use', float('nan')) / 2**30

  try:
    fwd = _function(backend)
  except Exception as err:  # noqa: BLE001 - the row says why
    row['errors'].append(_error_line(err))
    return row

  def fwd_bwd(a, b, s, g):
    out, vjp = jax.vjp(lambda a, b: fwd(a, b, s), a, b)
    return (out, *vjp(g))

  if backend == 'dense':
    rhs = rhs[0]
  got = None
  try:
    got = (jax.jit(fwd)(lhs, rhs, sizes),)
    row['fwd_ms'] = timing.median_ms(fwd, (lhs, rhs, sizes), iters)
    row['fwd_tflops'] = flops / row['fwd_ms'] / 1e9
  except Exception as err:  # noqa: BLE001
    row['errors'].append('fwd ' + _error_line(err))
  try:
    compiled = jax.jit(fwd_bwd).lower(lhs, rhs, sizes, cot).compile()
    analysis = compiled.memory_analysis()
    if analysis is not None:
      row['temp_gib'] = analysis.temp_size_in_bytes / 2**30
    got = compiled(lhs, rhs, sizes, cot)
    row['fwd_bwd_ms'] = timing.median_ms(fwd_bwd, (lhs, rhs, sizes, cot), iters)
    row['fwd_bwd_tflops'] = 3 * flops / row['fwd_bwd_ms'] / 1e9
  except Exception as err:  # noqa: BLE001
    row['errors'].append('fwd+bwd ' + _error_line(err))
  row['peak_gib'] = peak_gib()  # before the reference allocates its own
  if got is not None and backend != 'dense':
    try:
      want = _reference(lhs, rhs, sizes_np, cot)
      rel = lambda g, w: float(  # noqa: E731
        jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w)
      )
      row['rel_err'] = max(rel(g, w) for g, w in zip(got, want))
      row['checked'] = 'out' if len(got) == 1 else 'out, d lhs, d rhs'
    except Exception as err:  # noqa: BLE001
      row['errors'].append('check ' + _error_line(err))
  return row


def _child(spec: str, args) -> dict:
  """Runs one row in a fresh process (its own device memory peak; a crash costs one row)."""
  preset, projection, backend = spec.split(':')
  cmd = [sys.executable, '-m', 'benchmarks.grouped_matmul', '--row', spec]
  cmd += ['--tokens', str(args.tokens), '--iters', str(args.iters), '--dtype', args.dtype]
  cmd += ['--tiny'] if args.tiny else []
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false')  # the peak is this row's use
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout, env=env)
  except subprocess.TimeoutExpired:
    return dict(preset=preset, projection=projection, backend=backend, errors=['timed out'])
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT):
      return json.loads(line[len(_RESULT) :])
  tail = (proc.stderr.strip().splitlines() or ['no output'])[-1][:150]
  return dict(preset=preset, projection=projection, backend=backend, errors=[f'crashed: {tail}'])


def _fmt(row, key, spec):
  value = row.get(key)
  return (
    format(value, spec)
    if isinstance(value, (int, float))
    else format('-', f'>{spec.split(".")[0]}')
  )


def table(rows) -> str:
  """The one table; `*` marks each shape's fastest checked grouped matmul (rel err < 1e-2)."""
  best = {}
  for r in rows:
    if r['backend'] != 'dense' and r.get('rel_err', 1.0) < 1e-2 and 'fwd_bwd_ms' in r:
      key = (r['preset'], r['projection'])
      if key not in best or r['fwd_bwd_ms'] < best[key]['fwd_bwd_ms']:
        best[key] = r
  head = (
    f'{"preset":<17} {"proj":<5} {"shape (E: M x K -> N)":<24} {"backend":<12} {"fwd ms":>8} '
    f'{"TFLOP/s":>8} {"f+b ms":>8} {"TFLOP/s":>8} {"rel err":>8} {"temp GiB":>8} '
    f'{"peak GiB":>8}  error'
  )
  lines = [head, '-' * len(head)]
  for r in rows:
    dims = f'{r.get("experts", "?")}: {r.get("rows", "?")} x {r.get("k", "?")} -> {r.get("n", "?")}'
    mark = '*' if best.get((r['preset'], r['projection'])) is r else ' '
    lines.append(
      f'{r["preset"]:<17} {r["projection"]:<5} {dims:<24} {r["backend"] + mark:<12} '
      f'{_fmt(r, "fwd_ms", "8.3f")} {_fmt(r, "fwd_tflops", "8.1f")} '
      f'{_fmt(r, "fwd_bwd_ms", "8.3f")} {_fmt(r, "fwd_bwd_tflops", "8.1f")} '
      f'{_fmt(r, "rel_err", "8.1e")} {_fmt(r, "temp_gib", "8.2f")} {_fmt(r, "peak_gib", "8.2f")}'
      f'  {"; ".join(r.get("errors", []))}'
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tiny', action='store_true', help='toy shapes that run on CPU')
  parser.add_argument('--presets', nargs='+', default=list(PRESETS), choices=PRESETS)
  parser.add_argument('--projections', nargs='+', default=list(PROJECTIONS), choices=PROJECTIONS)
  parser.add_argument('--backends', nargs='+', default=list(BACKENDS), choices=BACKENDS)
  parser.add_argument('--tokens', type=int, default=16384, help='tokens (x top-k = rows)')
  parser.add_argument('--iters', type=int, default=10, help='timed calls per repeat')
  parser.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float32'))
  parser.add_argument('--row-timeout', type=int, default=300, help='seconds per row')
  parser.add_argument('--out', default='', help='also append each row as a JSON line here')
  parser.add_argument('--row', default='', help=argparse.SUPPRESS)  # PRESET:PROJ:BACKEND, a child
  args = parser.parse_args(argv)
  if args.tiny:
    args.tokens, args.iters = min(args.tokens, 40), min(args.iters, 2)
  if args.row:
    row = measure(
      *args.row.split(':'), tokens=args.tokens, tiny=args.tiny, iters=args.iters, dtype=args.dtype
    )
    print(_RESULT + json.dumps(row), flush=True)
    return 0
  rows = []
  for preset in args.presets:
    for projection in args.projections:
      for backend in args.backends:
        row = _child(f'{preset}:{projection}:{backend}', args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
          with open(args.out, 'a') as f:
            f.write(json.dumps(row) + '\n')
  device = next((r['device'] for r in rows if 'device' in r), '?')
  print(
    f'\ngrouped matmul on {device}, {args.dtype}, {args.tokens} tokens x top-k rows', flush=True
  )
  print(table(rows))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
