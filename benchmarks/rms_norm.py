"""python -m benchmarks.rms_norm [--batch 8 --length 2048 ...] (GPU)

The Pallas RMSNorm kernels (dlmjax/kernels/rms_norm.py) against the XLA formula they replace,
at the 1.7B step's shapes: the residual stream's norm ([B, L, D], with the stream's gradient
added in the backward) and the QK-norm with RoPE ([B, L, N, H]). For each: relative error of the
output and both gradients against the float32 formula (XLA's bf16 error beside it), then forward
and forward + backward times and the bandwidth they reach. --tiles also times other tile sizes.
Prints a table and writes one JSON line per row to --out.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from dlmjax.kernels import rms_norm as kernel
from benchmarks import timing
from dlmjax.model import layers

_BATCH = flags.DEFINE_integer('batch', 8, 'sequences')
_LENGTH = flags.DEFINE_integer('length', 2048, 'tokens per sequence')
_DIM = flags.DEFINE_integer('dim', 2048, 'd_model (the residual stream)')
_HEADS = flags.DEFINE_integer('heads', 16, 'query heads (the QK-norm rows)')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'head dim')
_ITERS = flags.DEFINE_integer('iters', 20, 'timed calls per repeat')
_TILES = flags.DEFINE_bool('tiles', True, 'also time other tile sizes')
_OUT = flags.DEFINE_string('out', '', 'append JSON lines here')
_EPS = 1e-6


def _cases(key):
  """{name: (xla fn, kernel fn(blocks), primal args, cotangents, bytes moved fwd, bwd)}."""
  b, length = _BATCH.value, _LENGTH.value
  d, n, h = _DIM.value, _HEADS.value, _HEAD_DIM.value
  k = jax.random.split(key, 6)
  x = jax.random.normal(k[0], (b, length, d), jnp.float32).astype(jnp.bfloat16)
  scale = (1 + 0.1 * jax.random.normal(k[1], (d,))).astype(jnp.bfloat16)
  g = tuple(jax.random.normal(k[2 + i], x.shape).astype(jnp.bfloat16) for i in range(2))
  q = jax.random.normal(k[4], (b, length, n, h), jnp.float32).astype(jnp.bfloat16)
  q_scale = (1 + 0.1 * jax.random.normal(k[5], (h,))).astype(jnp.bfloat16)
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  cos, sin = layers.rope_tables(positions, h, 1e4)
  size = x.size * 2
  return {
    'stream (residual)': (
      lambda x, s: (x, layers.rms_norm(x, s, _EPS)),
      lambda blocks: lambda x, s: kernel.rms_norm_residual(x, s, eps=_EPS, blocks=blocks),
      (x, scale),
      g,
      2 * size,
      4 * size,
    ),
    'qk-norm + rope': (
      lambda x, s: layers.rotary_embedding(layers.rms_norm(x, s, _EPS), positions, 1e4),
      lambda blocks: lambda x, s: kernel.rms_norm(x, s, eps=_EPS, cos=cos, sin=sin, blocks=blocks),
      (q, q_scale),
      g[0].reshape(q.shape),
      2 * q.size * 2,
      3 * q.size * 2,
    ),
  }


def _fwd_bwd(fn):
  def run(args, cotangent):
    y, vjp = jax.vjp(fn, *args)
    return y, vjp(cotangent)

  return run


def _checked(out):
  """y, dx and d(scale) of a (y or (x, y), grads) result."""
  y, grads = out
  return [y[-1] if isinstance(y, tuple) else y, *grads]


def main(argv):
  del argv
  rows = []
  for name, (xla_fn, kernel_fn, args, cot, fwd_bytes, bwd_bytes) in _cases(
    jax.random.key(0)
  ).items():
    want = _fwd_bwd(xla_fn)(
      jax.tree.map(lambda a: a.astype(jnp.float32), args),
      jax.tree.map(lambda a: a.astype(jnp.float32), cot),
    )
    errors = {}
    for label, fn in (('xla', xla_fn), ('pallas', kernel_fn(None))):
      got = jax.jit(_fwd_bwd(fn))(args, cot)
      errors[label] = [timing.rel_err(a, b) for a, b in zip(_checked(got), _checked(want))]
    variants = [('xla', xla_fn, None), ('pallas', kernel_fn(None), 'default')]
    if _TILES.value:
      for blocks in (
        kernel.Blocks(8192, 8, 8),
        kernel.Blocks(8192, 32, 8),
        kernel.Blocks(4096, 8, 4),
        kernel.Blocks(2048, 1, 4),
        kernel.Blocks(4096, 1, 2),
        kernel.Blocks(8192, 1, 8),
      ):
        variants.append(('pallas', kernel_fn(blocks), blocks))
    for label, fn, blocks in variants:
      # y alone forward; the gradients alone forward + backward: no copy of a returned x.
      fwd = timing.median_ms(lambda *a, fn=fn: _checked((fn(*a), ()))[0], args, _ITERS.value)
      both = timing.median_ms(lambda a, c, fn=fn: _fwd_bwd(fn)(a, c)[1], (args, cot), _ITERS.value)
      if isinstance(blocks, kernel.Blocks):
        blocks = [blocks.elements, blocks.steps, blocks.num_warps]
      row = dict(
        case=name,
        backend=label,
        blocks=blocks,
        fwd_ms=fwd,
        fwd_bwd_ms=both,
        fwd_gbps=fwd_bytes / fwd / 1e6,
        bwd_gbps=bwd_bytes / max(both - fwd, 1e-6) / 1e6,
        rel_err=errors[label],
        device=jax.devices()[0].device_kind,
      )
      rows.append(row)
      if _OUT.value:
        with open(_OUT.value, 'a') as f:
          f.write(json.dumps(row) + '\n')
  print(
    f'{"case":18s} {"backend":7s} {"blocks":16s} {"fwd ms":>7s} {"f+b ms":>7s} '
    f'{"fwd GB/s":>8s} {"bwd GB/s":>8s}  rel err (y, dx, dscale) vs f32'
  )
  for r in rows:
    err = ' '.join(f'{e:.1e}' for e in r['rel_err'])
    print(
      f'{r["case"]:18s} {r["backend"]:7s} {str(r["blocks"] or ""):16s} {r["fwd_ms"]:7.3f} '
      f'{r["fwd_bwd_ms"]:7.3f} {r["fwd_gbps"]:8.0f} {r["bwd_gbps"]:8.0f}  {err}'
    )


if __name__ == '__main__':
  np.set_printoptions(precision=3)
  app.run(main)
