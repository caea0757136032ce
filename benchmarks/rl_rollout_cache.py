"""python -m benchmarks.rl_rollout_cache [--checkpoint-path RUN] [options]

One rollout of the RL stage (configs/rl.py: its task's prompts, group size, the sampler group)
per sampler cache mode, greedy: the rollout's sampling and its exact scoring (the old policy's
log-probs on the sampled completions) through the stage's own RolloutBatches. Per mode the
seconds of a rollout (sampling, scoring; best of --repeats after a compiling one), its mean
reward and accuracy, and the share of completion tokens equal to `none`'s; one table last. The
cache changes only which completions are drawn (the scores stay exact), so a trained model's
rewards under `dual` against `none` say what the approximation costs RL. No reference model
(its log-probs are a second scoring pass, the same for every mode).

  python -m benchmarks.rl_rollout_cache --checkpoint-path runs/demo/seed0/sft --modes none,dual
  python -m benchmarks.rl_rollout_cache --tiny      # a CPU check: random tiny model, 4 prompts

Random weights (no --checkpoint-path) time the rollout but earn no reward.
"""

from __future__ import annotations

import argparse
import copy
import sys
import types

import jax

from dlmjax import config as config_lib
from dlmjax import inference
from dlmjax import model as model_lib
from dlmjax.diffusion import sampling_config
from dlmjax.rl import rollout as rollout_lib
from dlmjax.rl import sampler as rl_sampler
from dlmjax.train.stages import rl as rl_stage


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.rl_rollout_cache',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--config', default='configs/rl.py', help='the RL stage')
  parser.add_argument('--checkpoint-path', help='a trained run (its params and model)')
  parser.add_argument('--modes', default='none,dual', help='sampler.cache values')
  parser.add_argument('--thresholds', default='0', help='sampler.threshold values, each mode')
  parser.add_argument('--batch', type=int, help='rows per rollout (train.global_batch_size)')
  parser.add_argument('--gen-length', type=int, help='sampler.gen_length (steps: the same)')
  parser.add_argument('--block-length', type=int, help='sampler.block_length')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--tiny', action='store_true', help='CPU-sized: 8 rows, gen 16, block 8')
  return parser


def _config(args):
  config = config_lib.load_file(args.config)
  pretrained, config.init_from = None, args.checkpoint_path or ''  # the prompts' chat template
  if args.checkpoint_path:
    pretrained = inference.load_pretrained(args.checkpoint_path)
    config.model = copy.deepcopy(pretrained.config.model)
  if args.tiny:
    args.batch, args.gen_length, args.block_length = args.batch or 8, 16, 8
    args.repeats = 1
  if args.batch:
    config.train.global_batch_size = args.batch
  if args.gen_length:
    config.sampler.gen_length = config.sampler.steps = args.gen_length
  if args.block_length:
    config.sampler.block_length = args.block_length
  if jax.default_backend() != 'gpu':
    config.model.attention_backend, config.model.norm_backend = 'xla', 'xla'
  model_config = model_lib.ModelConfig.from_config(config)
  if pretrained is not None:
    params = pretrained.params
  else:
    params = jax.jit(model_lib.init_params, static_argnums=0)(model_config, jax.random.key(0))
  return config, model_config, params


def rollout(config, model_config, params, prompts, repeats) -> dict:
  """The stage's rollout 0 (its prompts and keys): a compiling call, then the best timed one."""
  setup = types.SimpleNamespace(model_config=model_config, mesh=None, lora=False)
  sampling = sampling_config.SamplingConfig.from_config(config)
  sampler = rl_sampler.RolloutSampler(config, setup, prompts.tokenizer, sampling, greedy=True)
  batches = rollout_lib.RolloutBatches(config, setup, prompts, sampler)
  best = None
  for _ in range(max(repeats, 1) + 1):
    batch, row = batches._rollout(0, params)  # pylint: disable=protected-access
    batches._batch = batch  # pylint: disable=protected-access  (compiled: no more notice)
    row['rollout_s'] = row['generate_s'] + row['score_s']
    if best is None or row['rollout_s'] < best[1]['rollout_s']:
      best = (batch, row)
  return dict(tokens=best[0]['tokens'], mask=best[0]['completion_mask'], **best[1])


def _table(rows) -> str:
  head = ('cache', 'threshold', 'rows', 'gen', 'sample s', 'score s', 'rollout s', 'x none')
  head += ('mean reward', 'accuracy', 'tokens as none')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    values = (
      r['cache'],
      r['threshold'],
      r['rows'],
      r['gen'],
      *(f'{r[k]:.2f}' for k in ('generate_s', 'score_s', 'rollout_s')),
      f'{r["speedup"]:.2f}',
      f'{r["reward"]:.3f}',
    )
    values += (f'{r["accuracy"]:.3f}', f'{r["same_as_none"]:.0%}')
    lines.append(' | '.join(str(v) for v in values))
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    modes = [m.strip() for m in args.modes.split(',') if m.strip()]
    thresholds = [float(t) for t in args.thresholds.split(',')]
    config, model_config, params = _config(args)
    runs = []
    for mode in modes:
      for threshold in thresholds:
        variant = copy.deepcopy(config)
        variant.sampler.cache, variant.sampler.threshold = mode, threshold
        variant.sampler.temperature = 0.0
        sampling_config.SamplingConfig.from_config(variant)  # bad settings: one line, before work
        runs.append(variant)
  except (ValueError, config_lib.ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if 'none' not in modes:
    print('error: --modes needs none (the baseline the others are compared to)', file=sys.stderr)
    return 2
  prompts = rl_stage.make_prompts(config)
  rows, base = [], None
  for variant in sorted(runs, key=lambda c: c.sampler.cache != 'none'):  # none first
    got = rollout(variant, model_config, params, prompts, args.repeats)
    if base is None:
      base = got
    same = (got['tokens'] == base['tokens'])[base['mask'] > 0]
    row = dict(
      cache=variant.sampler.cache,
      threshold=variant.sampler.threshold,
      rows=variant.train.global_batch_size,
      gen=variant.sampler.gen_length,
      generate_s=got['generate_s'],
      score_s=got['score_s'],
      rollout_s=got['rollout_s'],
      speedup=base['generate_s'] / got['generate_s'],
      reward=got['rollout_reward_mean'],
      accuracy=got['rollout_accuracy'],
      same_as_none=float(same.mean()) if same.size else 1.0,
    )
    print(row, flush=True)
    rows.append(row)
  print(_table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
