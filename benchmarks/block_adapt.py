"""python -m benchmarks.block_adapt [--ar-steps N --adapt-steps M ...]: AR -> block diffusion.

The recipe of configs/adapt_block_qwen3.py on the tiny model and the bundled corpus, on CPU: train
a causal LM autoregressively, then continue from it for the same number of steps with (a) the
block-diffusion objective (diffusion.objective=block, block_causal attention) and (b) masked
diffusion (mdm, bidirectional attention). Each is scored on the held-out split with its own
training objective under the fixed evaluation masks (train/evaluation.py): next-token NLL for AR,
the negative ELBO per token for the two diffusion models, each an upper bound on the NLL in
nats per token (lower is better; the AR figure is exact). LLaDA's Monte Carlo estimator
(diffusion/likelihood.py) masks across the whole continuation, which is the bound of a
bidirectional model only, so the block model is scored with BD3LM's bound instead. One table last.

  python -m benchmarks.block_adapt --ar-steps 300 --adapt-steps 300   # ~the tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def _parser():
  p = argparse.ArgumentParser(prog='python -m benchmarks.block_adapt', description=__doc__)
  p.add_argument('--out', default='runs/block_adapt', help='run directories go here (reused)')
  p.add_argument('--ar-steps', type=int, default=300)
  p.add_argument('--adapt-steps', type=int, default=300)
  p.add_argument('--block-size', type=int, default=4, help="SDAR's 4")
  p.add_argument('--seq-len', type=int, default=128)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--d-model', type=int, default=256)
  p.add_argument('--batch', type=int, default=32)
  p.add_argument('--lr', type=float, default=3e-3)
  p.add_argument('--adapt-lr', type=float, default=1e-3)
  p.add_argument('--eval-batches', type=int, default=8)
  p.add_argument('--scratch', action='store_true', help='also block diffusion from scratch')
  return p


def _config(args, name, steps, lr, **overrides):
  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib

  c = config_lib.load_file(os.path.join(os.path.dirname(__file__), '..', 'configs', 'tiny.py'))
  heads = max(1, args.d_model // 64)
  base = {
    'model.num_layers': args.layers,
    'model.d_model': args.d_model,
    'model.num_heads': heads,
    'model.num_kv_heads': heads,
    'model.head_dim': args.d_model // heads,
    'model.ffn_dim': 3 * args.d_model,
    'model.seq_len': args.seq_len,
    'train.steps': steps,
    'train.global_batch_size': args.batch,
    'train.micro_batch_size': args.batch,
    'train.lr': lr,
    'train.min_lr': lr / 10,
    'train.warmup_steps': max(1, steps // 10),
    'train.wsd_decay_steps': max(1, steps // 5),
    'diffusion.varlen_prob': 0.0,
    'checkpoint.every': 0,
    'eval.every': steps,
    'eval.batches': args.eval_batches,
    'log.every': max(1, steps // 10),
  }
  c = config_lib.apply_overrides(c, {**base, **overrides})
  c.output_dir = os.path.join(args.out, name)
  return c


def _train(config):
  """Trains (or finds finished) the run; returns (held-out loss, median tokens/s)."""
  # pylint: disable=import-outside-toplevel
  from dlmjax.train import loop

  path = os.path.join(config.output_dir, 'metrics.jsonl')
  if not _rows(path) or _rows(path)[-1].get('step') != config.train.steps:
    loop.train(config)
  rows = _rows(path)
  val = [r['val_loss'] for r in rows if 'val_loss' in r]
  speed = [r['tokens_per_s'] for r in rows if 'tokens_per_s' in r]
  return val[-1], (statistics.median(speed) if speed else float('nan'))


def _rows(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.seq_len % args.block_size:
    print(f'error: --seq-len {args.seq_len} is not a multiple of --block-size', file=sys.stderr)
    return 2
  ar_dir = os.path.join(args.out, 'ar')
  runs = [
    ('ar', 'random', 'ar', args.ar_steps, args.lr, {'model.attention_mask': 'causal'}),
    (
      'block',
      'ar',
      'block',
      args.adapt_steps,
      args.adapt_lr,
      {'model.attention_mask': 'block_causal', 'model.block_size': args.block_size},
    ),
    (
      'mdm',
      'ar',
      'mdm',
      args.adapt_steps,
      args.adapt_lr,
      {'model.attention_mask': 'bidirectional'},
    ),
  ]
  if args.scratch:
    runs.append(
      (
        'block_scratch',
        'random',
        'block',
        args.adapt_steps,
        args.lr,
        {'model.attention_mask': 'block_causal', 'model.block_size': args.block_size},
      )
    )
  results = []
  for name, init, objective, steps, lr, overrides in runs:
    config = _config(args, name, steps, lr, **{'diffusion.objective': objective, **overrides})
    if init == 'ar':
      config.init_from = ar_dir
    loss, speed = _train(config)
    results.append((name, init, objective, steps, loss, speed))
    print(json.dumps(dict(run=name, init=init, objective=objective, steps=steps, val=loss)))
  print(f'\nblock size {args.block_size}, seq {args.seq_len}, {args.layers} x {args.d_model}')
  print(f'{"run":<14}{"init":<8}{"objective":<10}{"steps":>6}{"held-out bound":>16}{"tok/s":>10}')
  for name, init, objective, steps, loss, speed in results:
    print(f'{name:<14}{init:<8}{objective:<10}{steps:>6}{loss:>16.4f}{speed:>10.0f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
