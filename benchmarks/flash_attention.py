"""python -m benchmarks.flash_attention [--batch 8 --length 2048 ...] (GPU)

Checks the Pallas flash attention (Triton, every mask kind, with and without documents and
padding; Mosaic GPU, bidirectional) against `xla_attention` (f32 on upcast inputs) on random bf16
inputs, then times forward and forward + backward at the 1.7B shape against cuDNN (plain, and with
the dense mask it needs for documents or block-causal). Prints a table and writes one JSON line
per row to --out.
TFLOP/s count the dense work, 4 B N L^2 H forward and 2.5 times that backward, for every mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from dlmjax.kernels import flash_attention as fa
from dlmjax.kernels import flash_attention_mgpu as fa_mgpu
from benchmarks import timing
from dlmjax.model import attention as attention_lib

_BATCH = flags.DEFINE_integer('batch', 8, 'sequences')
_LENGTH = flags.DEFINE_integer('length', 2048, 'tokens per sequence')
_HEADS = flags.DEFINE_integer('heads', 16, 'query heads')
_KV_HEADS = flags.DEFINE_integer('kv_heads', 8, 'key/value heads')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'head dim')
_DOCS = flags.DEFINE_integer('docs', 4, 'documents per sequence in the segment-id rows')
_BLOCK = flags.DEFINE_integer('block_size', 128, 'block_causal block size')
_ITERS = flags.DEFINE_integer('iters', 20, 'timed calls; the median is reported')
_CHECK = flags.DEFINE_bool('check', True, 'run the correctness checks first')
_TILES = flags.DEFINE_bool('tiles', True, 'also time other tile shapes (bidirectional)')
_OUT = flags.DEFINE_string('out', '', 'append JSON lines here')
_MASKS = flags.DEFINE_list('masks', [], 'time only the rows of these masks (default: all)')
_MOSAIC_TILES = flags.DEFINE_multi_string(
  'mosaic_tiles',
  [],
  'extra Mosaic GPU tiles to time (bidirectional), each as '
  'fwd_q,fwd_kv,fwd_stages,dq_q,dq_kv,dkv_kv,dkv_q,bwd_stages',
)


def _inputs(key, batch, length, heads, kv_heads, head_dim, dtype=jnp.bfloat16):
  k = jax.random.split(key, 4)
  q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dtype)
  kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(k[3], q.shape, jnp.float32).astype(dtype)
  return q, kk, v, do


def _documents(key, batch, length, docs):
  """Segment ids of `docs` documents of random lengths per row."""
  cuts = jnp.sort(jax.random.randint(key, (batch, docs - 1), 1, length), -1)
  return (jnp.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(jnp.int32)


def _fwd_bwd(fn):
  def run(q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do))

  return jax.jit(run)


def check(length=512, heads=4, kv_heads=2, head_dim=128, batch=2):
  """Relative errors of output and gradients (bf16 kernel vs f32 reference) per mask case."""
  rows = []
  for case, (kind, docs, padded) in {
    'bidirectional': ('bidirectional', False, False),
    'bidirectional+docs+pad': ('bidirectional', True, True),
    'causal+docs+pad': ('causal', True, True),
    'block_causal+docs': ('block_causal', True, False),
    'causal, ragged length': ('causal', False, False),
    'bidirectional (mosaic)': ('bidirectional', False, False),
  }.items():
    n = length - 12 if 'ragged' in case else length
    key = jax.random.key(len(rows))
    q, k, v, do = _inputs(key, batch, n, heads, kv_heads, head_dim)
    seg = _documents(jax.random.fold_in(key, 1), batch, n, 3) if docs else None
    valid = jnp.array([n - 37] + [n] * (batch - 1), jnp.int32) if padded else None
    kw = dict(kind=kind, block_size=64, segment_ids_BL=seg, valid_length_B=valid)
    visible = attention_lib.attention_mask(n, **kw)
    live = np.asarray(visible.any(-1))[:, :, None, None]  # rows that see some key
    do = jnp.where(live, do, 0)
    try:
      if 'mosaic' in case:
        got = _fwd_bwd(fa_mgpu.flash_attention_mgpu)(q, k, v, do)
      else:
        got = _fwd_bwd(lambda q, k, v: fa.flash_attention(q, k, v, **kw))(q, k, v, do)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rows.append(dict(case=case, error=f'{type(e).__name__}: {str(e)[:300]}'))
      continue
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _fwd_bwd(lambda q, k, v: attention_lib.xla_attention(q, k, v, **kw))(*f32)
    errs = [
      timing.rel_err(g, w, live if i == 0 else None) for i, (g, w) in enumerate(zip(got, want))
    ]
    dead_zero = bool(
      np.all(np.asarray(got[0], np.float32)[~np.broadcast_to(live, got[0].shape)] == 0)
    )
    rows.append(
      dict(
        case=case,
        err_o=errs[0],
        err_dq=errs[1],
        err_dk=errs[2],
        err_dv=errs[3],
        finite=bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in got)),
        dead_rows_zero=dead_zero,
      )
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def _cudnn_dense(q, k, v, *, kind, block_size, segment_ids_BL):
  """cuDNN through jax.nn with the dense boolean mask (what cuDNN needs for these cases)."""
  n = q.shape[1]
  mask = attention_lib.attention_mask(
    n, kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL
  )
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation='cudnn')


def timings(batch, length, heads, kv_heads, head_dim, docs, block_size, iters, tiles):
  q, k, v, do = _inputs(jax.random.key(0), batch, length, heads, kv_heads, head_dim)
  seg = _documents(jax.random.key(1), batch, length, docs)
  full_B = jnp.full((batch,), length, jnp.int32)  # padding lengths that hide nothing
  flops = 4 * batch * heads * length**2 * head_dim
  cases = [
    (
      'bidirectional',
      'cudnn',
      lambda q, k, v: attention_lib.cudnn_attention(q, k, v, kind='bidirectional'),
    ),
    ('bidirectional', 'pallas', lambda q, k, v: fa.flash_attention(q, k, v, kind='bidirectional')),
    ('bidirectional', 'mosaic', fa_mgpu.flash_attention_mgpu),
    (
      'bidirectional',
      'mosaic + lengths (all full)',
      lambda q, k, v: fa_mgpu.flash_attention_mgpu(q, k, v, valid_length_B=full_B),
    ),
    (
      'bidirectional',
      'cudnn + lengths (all full)',
      lambda q, k, v: attention_lib.cudnn_attention(
        q, k, v, kind='bidirectional', valid_length_B=full_B
      ),
    ),
    (
      'bidirectional',
      'xla',
      lambda q, k, v: attention_lib.xla_attention(q, k, v, kind='bidirectional'),
    ),
    ('causal', 'cudnn', lambda q, k, v: attention_lib.cudnn_attention(q, k, v, kind='causal')),
    ('causal', 'pallas', lambda q, k, v: fa.flash_attention(q, k, v, kind='causal')),
    (
      f'bidirectional+{docs}docs',
      'cudnn-dense-mask',
      lambda q, k, v: _cudnn_dense(q, k, v, kind='bidirectional', block_size=0, segment_ids_BL=seg),
    ),
    (
      f'bidirectional+{docs}docs',
      'pallas',
      lambda q, k, v: fa.flash_attention(q, k, v, kind='bidirectional', segment_ids_BL=seg),
    ),
    (
      f'block_causal{block_size}',
      'cudnn-dense-mask',
      lambda q, k, v: _cudnn_dense(
        q, k, v, kind='block_causal', block_size=block_size, segment_ids_BL=None
      ),
    ),
    (
      f'block_causal{block_size}',
      'pallas',
      lambda q, k, v: fa.flash_attention(q, k, v, kind='block_causal', block_size=block_size),
    ),
  ]
  if tiles:  # (fwd, dq, dkv) as (block_q, block_k, warps, stages)
    for t in [
      ((128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
      ((128, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),
    ]:
      t = fa.Tiles(*(fa.Tile(*x) for x in t))
      name = ' '.join(
        f'{k}={tuple(dataclasses.astuple(getattr(t, k)))}' for k in ('fwd', 'dq', 'dkv')
      )
      cases.append(('bidirectional', f'pallas {name}', _with_tiles(t)))
  for spec in _MOSAIC_TILES.value:
    t = fa_mgpu.MosaicTiles(*map(int, spec.split(',')))
    cases.append(
      ('bidirectional', f'mosaic {spec}', functools.partial(fa_mgpu.flash_attention_mgpu, tiles=t))
    )
  if _MASKS.value:
    cases = [c for c in cases if c[0] in _MASKS.value]
  rows = []
  for mask, backend, fn in cases:
    row = dict(mask=mask, backend=backend)
    try:
      row['fwd_ms'] = timing.median_ms(fn, (q, k, v), iters)
      row['fwd_bwd_ms'] = timing.median_ms(_fwd_bwd(fn), (q, k, v, do), iters)
      row['fwd_tflops'] = flops / row['fwd_ms'] / 1e9
      row['fwd_bwd_tflops'] = 3.5 * flops / row['fwd_bwd_ms'] / 1e9
    except Exception as e:  # pylint: disable=broad-except
      row['error'] = f'{type(e).__name__}: {str(e)[:300]}'
      traceback.print_exc()
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def _with_tiles(tiles):
  return lambda q, k, v: fa.flash_attention(q, k, v, kind='bidirectional', tiles=tiles)


def main(argv):
  del argv
  meta = dict(
    device=jax.devices()[0].device_kind,
    jax=jax.__version__,
    date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
  )
  print(json.dumps(meta), flush=True)
  checks = check() if _CHECK.value else []
  rows = timings(
    _BATCH.value,
    _LENGTH.value,
    _HEADS.value,
    _KV_HEADS.value,
    _HEAD_DIM.value,
    _DOCS.value,
    _BLOCK.value,
    _ITERS.value,
    _TILES.value,
  )
  if _OUT.value:
    with open(_OUT.value, 'a') as f:
      for r in [meta, *checks, *rows]:
        f.write(json.dumps(r) + '\n')
  print(f'\n{"mask":<22} {"backend":<64} {"fwd ms":>8} {"TF/s":>6} {"f+b ms":>8} {"TF/s":>6}')
  for r in rows:
    if 'error' in r:
      print(f'{r["mask"]:<22} {r["backend"]:<64} error: {r["error"][:80]}')
    else:
      print(
        f'{r["mask"]:<22} {r["backend"]:<64} {r["fwd_ms"]:8.3f} {r["fwd_tflops"]:6.0f} '
        f'{r["fwd_bwd_ms"]:8.3f} {r["fwd_bwd_tflops"]:6.0f}'
      )
  for c in checks:
    if 'error' in c:
      print(f'check {c["case"]:<24} error: {c["error"][:200]}')
      continue
    print(
      f'check {c["case"]:<24} o {c["err_o"]:.1e} dq {c["err_dq"]:.1e} dk {c["err_dk"]:.1e} '
      f'dv {c["err_dv"]:.1e} finite {c["finite"]} dead-rows-zero {c["dead_rows_zero"]}'
    )


if __name__ == '__main__':
  app.run(main)
