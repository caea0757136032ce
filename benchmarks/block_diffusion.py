"""python -m benchmarks.block_diffusion [--tiny] (GPU): the block-diffusion step against mdm.

1. Correctness: the Pallas kernel's two-stream mask (with tile skipping and without) against the
   XLA reference, forward and gradients, on random inputs with two documents and a cut row.
2. Attention alone, forward + backward at [x_t || x_0] = 2 x --seq-len: the two-stream mask with
   tile skipping, the same kernel visiting every tile (the dense mask, no skipping), and cuDNN's
   plain bidirectional attention over 2 x seq (the cost of attention with no mask at all) and
   over seq (the mdm step's attention).
3. The train step of --config (the 1.7B by default) with diffusion.objective=block
   (block_causal, the Pallas kernel) against objective=mdm (the config's own backend), tokens/s
   counting real tokens (rows x seq_len, not the doubled sequence), MFU on the same count
   (FLOPs per real token with the layers on 2 x seq: ModelConfig.flops_per_token(streams=2)).
One table last. --tiny shrinks everything to run on CPU (interpret mode) as a proof that it runs.

  python -m benchmarks.block_diffusion                      # H200, about 3 minutes
  python -m benchmarks.block_diffusion --tiny               # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from dlmjax import bench
from dlmjax import config as config_lib
from dlmjax.kernels import flash_attention as fa
from dlmjax.model import attention as attention_lib
from dlmjax.model import presets

_ROOT = os.path.join(os.path.dirname(__file__), '..')


def _parser():
  p = argparse.ArgumentParser(prog='python -m benchmarks.block_diffusion', description=__doc__)
  p.add_argument('--config', default=os.path.join(_ROOT, 'configs', 'pretrain_1p7b.py'))
  p.add_argument('--seq-len', type=int, default=2048)
  p.add_argument('--block-size', type=int, default=4, help="SDAR's 4 (BD3LM trains 16)")
  p.add_argument('--batch', type=int, default=8, help='rows per step')
  p.add_argument('--micro-batch', type=int, default=4)
  p.add_argument('--steps', type=int, default=5, help='timed train steps per objective')
  p.add_argument('--iters', type=int, default=10, help='timed attention calls')
  p.add_argument('--tiny', action='store_true', help='CPU-sized shapes (interpret mode)')
  return p


def _inputs(key, batch, length, heads, kv_heads, head_dim, dtype):
  k = jax.random.split(key, 4)
  q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dtype)
  kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(k[3], q.shape, jnp.float32).astype(dtype)
  return q, kk, v, do


def _fwd_bwd(fn):
  def run(q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do))

  return run


def check(half, block, heads, kv_heads, head_dim, dtype) -> dict:
  """Max relative error of the kernel (skipping, and not) against the f32 XLA reference."""
  q, k, v, do = _inputs(jax.random.key(0), 2, 2 * half, heads, kv_heads, head_dim, dtype)
  cut = np.arange(half) >= half // 3
  seg_half = jnp.asarray(np.stack([np.ones(half), 1 + cut]), jnp.int32)
  seg = jnp.concatenate([seg_half, seg_half], axis=1)
  valid = jnp.array([half - half // 4, half], jnp.int32)
  kw = dict(kind='two_stream', block_size=block, segment_ids_BL=seg, valid_length_B=valid)
  live = np.asarray(attention_lib.attention_mask(2 * half, **kw).any(-1))[:, :, None, None]
  do = jnp.where(live, do, 0).astype(dtype)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = jax.jit(_fwd_bwd(lambda q, k, v: attention_lib.xla_attention(q, k, v, **kw)))(*f32)
  errors = {}
  for skip in (True, False):
    got = jax.jit(
      _fwd_bwd(lambda q, k, v, skip=skip: fa.flash_attention(q, k, v, skip_tiles=skip, **kw))
    )(q, k, v, do)
    errors[skip] = max(
      timing.rel_err(g, w, live if i == 0 else None) for i, (g, w) in enumerate(zip(got, want))
    )
  return errors


def attention_rows(batch, half, block, heads, kv_heads, head_dim, dtype, iters) -> list[dict]:
  """Forward + backward milliseconds of the attention variants at 2 x half (and half)."""
  q, k, v, do = _inputs(jax.random.key(1), batch, 2 * half, heads, kv_heads, head_dim, dtype)
  two = dict(kind='two_stream', block_size=block)
  variants = [
    ('two_stream, tile skipping', lambda q, k, v: fa.flash_attention(q, k, v, **two)),
    (
      'two_stream, every tile (dense)',
      lambda q, k, v: fa.flash_attention(q, k, v, skip_tiles=False, **two),
    ),
  ]
  on_gpu = jax.default_backend() == 'gpu'
  if on_gpu:
    bidirectional = dict(kind='bidirectional')
    variants += [
      (
        'cudnn bidirectional, 2 x seq',
        lambda q, k, v: attention_lib.cudnn_attention(q, k, v, **bidirectional),
      ),
    ]
  rows = []
  for name, fn in variants:
    ms = timing.median_ms(_fwd_bwd(fn), (q, k, v, do), iters, repeats=3 if on_gpu else 1)
    rows.append(dict(what=f'attention: {name}', seq=2 * half, ms=round(ms, 3)))
  if on_gpu:
    args = tuple(x[:, :half] for x in (q, k, v, do))
    ms = timing.median_ms(
      _fwd_bwd(lambda q, k, v: attention_lib.cudnn_attention(q, k, v, kind='bidirectional')),
      args,
      iters,
      repeats=3,
    )
    rows.append(dict(what='attention: cudnn bidirectional, seq (mdm)', seq=half, ms=round(ms, 3)))
  dense = rows[1]['ms']
  for row in rows:
    row['vs_dense'] = round(dense / row['ms'], 2)
  return rows


def step_config(args, objective):
  config = config_lib.load_file(args.config)
  if args.tiny:
    presets.apply_preset(config.model, 'tiny')
    config.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16)
    config.model.update(ffn_dim=128, vocab_size=512, mask_token_id=3, eos_token_id=2)
    config.model.update(pad_token_id=0, dtype='float32', remat='none', norm_backend='xla')
    config.model.attention_backend = 'xla'
    config.data.source = 'builtin'
  config.model.seq_len = args.seq_len
  config.train.global_batch_size, config.train.micro_batch_size = args.batch, args.micro_batch
  config.train.warmup_steps, config.train.wsd_decay_steps = 1, 1
  config.diffusion.varlen_prob = 0.0
  config.diffusion.objective = objective
  if objective == 'block':
    config.model.attention_mask, config.model.block_size = 'block_causal', args.block_size
    config.model.attention_backend = 'pallas'  # cuDNN cannot take the two-stream mask
  config_lib.validate(config)
  return config


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.tiny:
    args.seq_len, args.batch, args.micro_batch = min(args.seq_len, 32), 2, 2
    args.steps, args.iters = min(args.steps, 2), min(args.iters, 2)
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  heads, kv_heads, head_dim = (4, 2, 16) if args.tiny else (16, 8, 128)
  try:
    errors = check(16 if args.tiny else 256, args.block_size, heads, kv_heads, head_dim, dtype)
    limit = 1e-4 if args.tiny else 2e-2
    print(json.dumps(dict(check='two_stream vs xla', skipping=errors[True], dense=errors[False])))
    if max(errors.values()) > limit:
      print(
        f'error: the kernel is off the reference by {max(errors.values()):.2e}', file=sys.stderr
      )
      return 1
    rows = attention_rows(
      1 if args.tiny else 8, args.seq_len, args.block_size, heads, kv_heads, head_dim, dtype,
      args.iters,
    )  # fmt: skip
    for row in rows:
      print(json.dumps(row), flush=True)
    steps = {}
    for objective in ('mdm', 'block'):
      result = bench.run(step_config(args, objective), args.steps, 1, matmul=False)
      steps[objective] = result
      print(json.dumps(dict(objective=objective, **result)), flush=True)
  except (ValueError, config_lib.ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  device = jax.devices()[0].device_kind
  print(f'\n{device}; block {args.block_size}, seq {args.seq_len} (attention at 2 x seq)')
  print(f'{"what":<52}{"value":>14}{"ratio":>8}')
  for row in rows:
    print(f'{row["what"]:<52}{row["ms"]:>11.3f} ms{row["vs_dense"]:>7.2f}x')
  base = steps['mdm']['tokens_per_s']
  for objective, result in steps.items():
    mfu = result.get('mfu_datasheet')
    what = f'train step {objective} ({result["attention"]}), real tokens/s'
    tail = f'  MFU {100 * mfu:.1f}%' if mfu else ''
    print(f'{what:<52}{result["tokens_per_s"]:>14,}{result["tokens_per_s"] / base:>7.2f}x{tail}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
