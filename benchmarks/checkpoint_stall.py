"""How long a checkpoint save holds training up: blocked seconds per save, and the tokens/s of the
steps that save against the others (docs/benchmarks.md, Checkpoints).

    python -m benchmarks.checkpoint_stall --output-dir /ckpt/stall           # 1.7B, one GPU
    python -m benchmarks.checkpoint_stall --tiny --output-dir /tmp/stall     # CPU, seconds

The 1.7B recipe (configs/pretrain_1p7b.py) on the built-in corpus, saving every 2 steps (the
async save blocks only while each shard is checksummed on its device and copied to host memory;
orbax writes the files in the background). Correctness: the last checkpoint is restored and its
checksums (params, optimizer state, step, data state) are verified before the table prints.
The goal is <= 1 s blocked per save at the 1.7B on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics

import jax

from dlmjax import config as config_lib
from dlmjax.checkpoint import manager
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import loop
from dlmjax.train import state as state_lib

ROOT = os.path.join(os.path.dirname(__file__), '..')


def make_config(args):
  c = config_lib.load_file(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'))
  c.data.source = 'builtin'
  c.data.tokenizer = ''
  # The built-in corpus's tokenizer and its special ids (as configs/pretrain_1p7b.py's smoke run).
  c.model.vocab_size, c.model.mask_token_id, c.model.eos_token_id = 4096, 3, 2
  c.model.pad_token_id = 0
  if args.tiny:  # CPU: configs/tiny.py's model
    tiny = config_lib.load_file(os.path.join(ROOT, 'configs', 'tiny.py'))
    c.model = tiny.model
    c.model.seq_len = 64
    c.train.global_batch_size, c.train.micro_batch_size = 16, 8
  # Else the recipe's 256 x 2048 tokens per step (~10 s on one H200): a save's background write
  # (params + optimizer state, 20 GB at the 1.7B) has a step's time to finish before the next.
  c.train.global_batch_size = args.global_batch_size or c.train.global_batch_size
  c.train.micro_batch_size = args.micro_batch_size or c.train.micro_batch_size
  c.train.steps = args.steps
  c.train.warmup_steps = 1
  c.train.wsd_decay_steps = 1
  c.checkpoint.every = args.every
  c.checkpoint.keep = 2
  c.log.every = 1
  c.log.outputs = ''
  c.eval.every = 0
  c.output_dir = args.output_dir
  return c


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--output-dir', required=True, help='emptied first')
  parser.add_argument('--tiny', action='store_true', help='a CPU-sized model')
  parser.add_argument('--steps', type=int, default=12)
  parser.add_argument('--every', type=int, default=2)
  parser.add_argument('--global-batch-size', type=int, default=0, help="0: the recipe's")
  parser.add_argument('--micro-batch-size', type=int, default=0, help="0: the recipe's")
  args = parser.parse_args(argv)
  shutil.rmtree(args.output_dir, ignore_errors=True)
  config = make_config(args)
  loop.train(config)
  with open(os.path.join(args.output_dir, 'metrics.jsonl')) as f:
    rows = [r for r in map(json.loads, f) if 'tokens_per_s' in r]
  # Step 1 compiles; step 2 is the first timed against a warm step.
  rows = [r for r in rows if r['step'] > 1]
  saving = [r for r in rows if 'checkpoint_blocked_s' in r]
  other = [r for r in rows if 'checkpoint_blocked_s' not in r]
  # Correctness: the last save restores with every checksum verified.
  check = config_lib.from_dict(config.to_dict())
  setup = state_lib.TrainSetup(check, mesh_lib.make_mesh(check))
  checkpoints = manager.RunCheckpoints(args.output_dir)
  state, _ = checkpoints.restore_latest(setup)
  checkpoints.close()
  assert int(jax.device_get(state['step'])) == args.steps
  print(f'{setup.model_config.num_params():,} parameters; {jax.devices()[0].device_kind}')
  print('| step | blocked s | tokens/s |')
  print('|---|---|---|')
  for r in saving:
    print(f'| {r["step"]} | {r["checkpoint_blocked_s"]:.3f} | {r["tokens_per_s"]:,.0f} |')
  blocked = [r['checkpoint_blocked_s'] for r in saving]
  print()
  print('| steps | n | blocked s per save (median / max) | tokens/s (median) |')
  print('|---|---|---|---|')
  print(
    f'| saving | {len(saving)} | {statistics.median(blocked):.3f} / {max(blocked):.3f} | '
    f'{statistics.median(r["tokens_per_s"] for r in saving):,.0f} |'
  )
  print(
    f'| other | {len(other)} | - | {statistics.median(r["tokens_per_s"] for r in other):,.0f} |'
  )


if __name__ == '__main__':
  main()
