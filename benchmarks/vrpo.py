"""VRPO's GPU table (docs/preference.md): quality over seeds, the step's speed beside SFT's, and
the 8B LoRA shape's memory and speed.

    python -m benchmarks.vrpo quality --init-from runs/sft_0p6b --seeds 0,1,2 [-- --config.x=y]
    python -m benchmarks.vrpo speed --preset qwen3_0p6b --seq 512 --batch 16    # full fine-tuning
    python -m benchmarks.vrpo speed --preset llada_8b --seq 2048 --batch 4 --lora-rank 128
    python -m benchmarks.vrpo speed --tiny                                       # CPU: it runs
    python -m benchmarks.vrpo speed --preset qwen3_0p6b --seq 512 --batch 16 --stages sft,reward

quality: per seed, one `dlmjax.train --config=configs/vrpo.py` run from an SFT checkpoint. It
prints the held-out pairs' val_margin, val_preference_accuracy and val_elbo_accuracy after VRPO,
with val_reference_elbo_accuracy (the SFT model) as "before", and the mean +- std over seeds, as
one JSON line. speed: dlmjax.bench's timing of the real compiled step on random pairs, for SFT and
for VRPO at the same model, canvas and batch, plus the reference's scoring that VRPO's batch
source adds before each step. It prints one JSON line: tokens/s counted as rows x seq_len (a
VRPO row is a pair, so 2 x seq_len tokens go through the model per row and per ELBO copy), the
peak memory and the compile time. --stages sft,reward times the reward model's step instead (a
reward row is a pair too: 2 x seq_len tokens, one clean forward each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _quality(args, extra) -> dict:
  rows = []
  for seed in [int(s) for s in args.seeds.split(',')]:
    out = os.path.join(args.output_dir, f'seed{seed}')
    cmd = [
      sys.executable,
      '-m',
      'dlmjax.train',
      f'--config={args.config}',
      f'--config.init_from={args.init_from}',
      f'--config.seed={seed}',
      f'--config.output_dir={out}',
      *extra,
    ]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, 'metrics.jsonl')) as f:
      evals = [r for r in map(json.loads, f) if 'val_margin' in r]
    rows.append(dict(seed=seed, **evals[-1]))
  keys = ('val_margin', 'val_preference_accuracy', 'val_elbo_accuracy')
  summary = {
    k: dict(mean=float(np.mean([r[k] for r in rows])), std=float(np.std([r[k] for r in rows])))
    for k in (*keys, 'val_reference_elbo_accuracy')
  }
  return dict(part='quality', init_from=args.init_from, per_seed=rows, summary=summary)


def _config(args, stage: str):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  c = config_lib.defaults()
  c.stage = stage
  c.init_from = 'random-weights'  # validation only: init_state draws the weights
  if args.tiny:
    c.model.num_layers, c.model.d_model, c.model.ffn_dim = 2, 64, 128
    c.model.num_heads = c.model.num_kv_heads = 4
    c.model.head_dim, c.model.vocab_size = 16, 256
    c.model.mask_token_id, c.model.eos_token_id, c.model.pad_token_id = 255, 254, 254
  else:
    presets.apply_preset(c.model, args.preset)
    c.model.dtype = 'bfloat16'
    c.model.remat = args.remat
  c.model.seq_len = args.seq
  c.model.loss_chunk_tokens = 0 if args.tiny else min(2048, args.micro * args.seq)
  c.train.global_batch_size, c.train.micro_batch_size = args.batch, args.micro
  c.train.warmup_steps = c.train.wsd_decay_steps = 0
  c.train.schedule = 'constant'
  c.train.check_memory = False
  c.train.lora.rank = args.lora_rank
  c.preference.budget = args.budget
  return config_lib.apply_overrides(c, [])


def _speed(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import vrpo  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train.stages import preference  # pylint: disable=import-outside-toplevel

  result = dict(part='speed', preset='tiny' if args.tiny else args.preset, lora=args.lora_rank)
  stages = args.stages.split(',')
  for stage in stages:
    config = _config(args, stage)
    result[stage] = bench.run(config, steps=args.steps, warmup=1, matmul=False)
    # On stderr as it comes: a later stage failing (out of memory) keeps this one's figures.
    print(json.dumps({stage: result[stage]}), file=sys.stderr, flush=True)
  if 'preference' not in stages:
    return result
  # The reference's ELBOs that the batch source scores before each VRPO step.
  config = _config(args, 'preference')
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  params = setup.model_params(setup.init_state(config.seed)['params'])
  scorer = preference.Scorer(config, setup, setup.model_config)
  batch = preference.stage(config).example_batch(np.random.default_rng(0))
  jax.block_until_ready(scorer(params, batch, vrpo.POLICY_STREAM))
  start = time.perf_counter()
  for _ in range(args.steps):
    jax.block_until_ready(scorer(params, batch, vrpo.POLICY_STREAM))
  reference_s = (time.perf_counter() - start) / args.steps
  step_s = result['preference']['step_time_s'] + reference_s
  result['preference_reference_s'] = round(reference_s, 4)
  result['preference_tokens_per_s_with_reference'] = round(args.batch * args.seq / step_s)
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.vrpo', description=__doc__)
  parser.add_argument('part', choices=('quality', 'speed'))
  parser.add_argument('--init-from', default='runs/sft', help='quality: the SFT run')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--config', default='configs/vrpo.py')
  parser.add_argument('--output-dir', default='runs/bench_vrpo')
  parser.add_argument('--tiny', action='store_true', help='speed: a 2-layer model on CPU')
  parser.add_argument('--preset', default='qwen3_0p6b')
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--batch', type=int, default=8, help='rows (pairs) per step')
  parser.add_argument('--micro', type=int, default=0, help='rows per micro-batch (0: --batch)')
  parser.add_argument('--lora-rank', type=int, default=0)
  parser.add_argument('--budget', type=int, default=8, help='preference.budget')
  parser.add_argument('--remat', default='full')
  parser.add_argument('--steps', type=int, default=5, help='timed steps')
  parser.add_argument(
    '--stages',
    default='sft,preference',
    help='speed: the stages timed, of sft, preference (VRPO) and reward (the reward model)',
  )
  args, extra = parser.parse_known_args(argv)
  args.micro = args.micro or args.batch
  print(json.dumps(_quality(args, extra) if args.part == 'quality' else _speed(args)), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
