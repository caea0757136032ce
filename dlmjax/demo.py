"""python -m dlmjax.demo: pre-train -> SFT -> RL on the tiny model, each stage scored held-out.

  python -m dlmjax.demo [--seeds 0,1,2] [--output-dir runs/demo] [--task arithmetic]
                        [--objective d1|espo|spg]

Per seed, the three stages run through the normal trainer (`dlmjax.train.loop.train` on
configs/tiny.py, configs/sft.py and configs/rl.py with the RECIPE below on top), each from the
previous one's checkpoint. Every stage's checkpoint is then decoded greedily on the task's
held-out split with one sampler setting (dlmjax.evaluate's tasks mode) and checked with
dlmjax.verify; RL's is the one of best validation reward (train-split problems, every 10 steps).
The table gives per seed, then mean +- std over seeds: steps, final loss, held-out accuracy and
mean reward, and the RL gain over SFT against the seed-to-seed spread. It is also
written to OUTPUT_DIR/results.json (results_<objective>.json for espo / spg). A rerun resumes
finished or cut stages from their checkpoints; another --objective reuses the seeds' pre-training
and SFT runs and trains only its own RL stage (OUTPUT/seedN/rl_<objective>).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import numpy as np

STAGES = ('pretrain', 'sft', 'rl')
_CONFIG_FILES = {'pretrain': 'tiny.py', 'sft': 'sft.py', 'rl': 'rl.py'}

# Per task: (prompt width, generated tokens) of the rollouts and the held-out decoding; their sum
# is the canvas, every stage's model.seq_len (RoPE has no length-bound weights). From each task's
# longest plain-template prompt and answer (+ EOS) on the built-in tokenizer; a sudoku4 prompt is
# 44 tokens, its answer 27 + EOS. Two tokens per diffusion step (half the rollout time of one),
# one block.
TASK_CANVAS = {'sudoku4': (48, 32), 'arithmetic': (22, 58), 'countdown3': (36, 44),
               'countdown4': (40, 56)}


def canvas_overrides(task: str) -> dict:
  """Per stage, the keys TASK_CANVAS sets: seq_len everywhere, the RL sampler's widths and steps."""
  if task not in TASK_CANVAS:
    raise ValueError(f'--task {task!r}: the demo is sized for {sorted(TASK_CANVAS)}.')
  prompt, gen = TASK_CANVAS[task]
  canvas = {'model.seq_len': prompt + gen}
  return {'pretrain': canvas, 'sft': canvas,
          'rl': {**canvas, 'rl.max_prompt_tokens': prompt, 'sampler.gen_length': gen,
                 'sampler.steps': gen // 2, 'sampler.block_length': gen}}


RL_STEPS = 60  # 15 rollouts: about 4 minutes of a seed's 9
SELECT_EVERY = 10  # RL steps between the validation scores that pick the RL stage's checkpoint

# The recipe: overrides of configs/{tiny,sft,rl}.py, sized for minutes per seed on a shared 2-core
# CPU. Measured over seeds 0-2 (docs/benchmarks.md, "Three-stage result"): on arithmetic RL gains
# +0.52 mean reward against an SFT seed-to-seed spread of 0.39; on sudoku4 (before checkpoint
# selection) +0.007 against 0.06. RECIPE carries sudoku4's canvas; recipe_for() resizes the canvas
# and the sampler for the other tasks.
_STAGE_RECIPE = {
    'pretrain': {
        'train.steps': 40,  # the code corpus barely helps sudoku: a short stage, as a start.
        'train.wsd_decay_steps': 8,
        'checkpoint.every': 0,  # the final step only
    },
    'sft': {
        'train.steps': 240,  # copy the givens, then fill: trial reward 0.24 / 0.36 / 0.66 at
        'train.lr': 2e-3,  # 80 / 160 / 240 steps, but seed-dependent (demo seeds: 0.26-0.37).
        'train.min_lr': 2e-4,
        'train.warmup_steps': 10,
        'train.wsd_decay_steps': 24,  # LLaDA: decay over the final 10%
        'checkpoint.every': 0,
    },
    'rl': {
        'rl.group_size': 4,  # 8 prompts x 4 per rollout: more prompts seen than 4 x 8.
        'rl.inner_updates': 4,  # updates are cheap next to generation (d1: 8 on sudoku).
        'train.global_batch_size': 32,
        'train.micro_batch_size': 16,
        'train.lr': 3e-4,  # 1e-4 barely moved it; 6e-4 collapsed (rollout reward 0.7 -> 0.35).
        'train.warmup_steps': 4,  # Adam's first step at full lr is sign-like: KL 1.7 after it.
        'train.steps': RL_STEPS,
        # Held-out reward jumps by 0.2-0.7 between checkpoints 10 steps apart (docs/benchmarks.md
        # RL diagnosis item 9), so the RL row is the checkpoint of best validation reward:
        # 128 train-split problems outside the RL prompts, greedy, every 10 steps. The test
        # split only scores the chosen one (and the final one, for comparison).
        'eval.every': SELECT_EVERY,
        'eval.batches': 4,
        'rl.eval_split': 'valid',
        'checkpoint.every': SELECT_EVERY,
        'checkpoint.keep': RL_STEPS // SELECT_EVERY,
    },
}
RECIPE = {stage: {**canvas_overrides('sudoku4')[stage], **keys}
          for stage, keys in _STAGE_RECIPE.items()}
CANVAS = RECIPE['rl']['model.seq_len']  # sudoku4's: 80
# --objective: the RL stage's objective on top of RECIPE. SPG trains without a KL term, so it
# gets lr 3e-5, the stable end of the GPU search (docs/benchmarks.md: 1e-4 collapses without KL).
# Each objective has its own RL run directory; all start from the same SFT checkpoints.
OBJECTIVES = {'d1': {}, 'espo': {'rl.objective': 'espo'},
              'spg': {'rl.objective': 'spg', 'rl.kl_beta': 0.0, 'train.lr': 3e-5}}
SFT_EXAMPLES = 4000  # task training examples written as the SFT set (worked solutions)
EVAL_EXAMPLES = 128  # held-out problems per stage and seed (the same ones for every stage)
EVAL_BATCH = 16
EVAL_SEED = 0  # held-out set and decoding key: fixed, so stages and seeds see the same problems


def recipe_for(objective: str, task: str = 'sudoku4') -> dict:
  """RECIPE sized for `task`'s canvas, with the RL stage switched to `objective`."""
  if objective not in OBJECTIVES:
    raise ValueError(f'--objective {objective!r}: choose one of {sorted(OBJECTIVES)}.')
  recipe = copy.deepcopy(RECIPE)
  for stage, keys in canvas_overrides(task).items():
    recipe[stage].update(keys)
  recipe['rl'].update(OBJECTIVES[objective])
  return recipe


def eval_sampling(recipe=RECIPE):
  """Greedy decoding with the rollouts' canvas, gen length, steps and blocks."""
  from dlmjax.diffusion import sampler as sampler_lib  # pylint: disable=import-outside-toplevel
  r = recipe['rl']
  return sampler_lib.SamplingConfig(gen_length=r['sampler.gen_length'],
                                    steps=r['sampler.steps'],
                                    block_length=r['sampler.block_length'], temperature=0.0)


# ----------------------------------------------------------------------------------------------
# Configs


def configs_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def stage_configs(seed: int, run_dir: str, task: str, recipe=None) -> dict:
  """The three stage configs of one seed: OUTPUT/seedN/{pretrain,sft,rl}, each from the last
  (recipe: recipe_for('d1', task) unless given)."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  recipe = recipe or recipe_for('d1', task)
  if not os.path.isdir(configs_dir()):
    raise FileNotFoundError(f'{configs_dir()} does not exist: the demo builds on the '
                            "repository's configs/; run it from a source checkout of dlmjax.")
  objective = recipe['rl'].get('rl.objective', 'd1')
  names = dict(zip(STAGES, STAGES), rl='rl' if objective == 'd1' else f'rl_{objective}')
  configs = {}
  for stage in STAGES:
    c = config_lib.load_file(os.path.join(configs_dir(), _CONFIG_FILES[stage]))
    config_lib.apply_overrides(c, recipe[stage])
    c.seed = seed
    c.output_dir = os.path.join(run_dir, names[stage])
    c.log.outputs = ''
    if stage == 'sft':
      c.init_from = configs['pretrain'].output_dir
      c.sft.train_file = os.path.join(run_dir, f'sft_{task}.jsonl')
    elif stage == 'rl':
      c.init_from = configs['sft'].output_dir
      c.rl.task = task
    configs[stage] = c
  return configs


def write_sft_set(path: str, task: str, num: int = SFT_EXAMPLES, seed: int = 0) -> str:
  """Worked solutions of the task's TRAIN split as SFT rows (the held-out split never enters)."""
  from dlmjax import tasks as tasks_lib  # pylint: disable=import-outside-toplevel
  examples = tasks_lib.get_task(task).examples('train', num, seed)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w') as f:
    for e in examples:
      f.write(json.dumps({'prompt': e.prompt, 'response': e.response}) + '\n')
  os.replace(tmp, path)
  return path


# ----------------------------------------------------------------------------------------------
# One seed


def _metric_rows(run_dir: str) -> list[dict]:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def final_loss(run_dir: str, step: int | None = None) -> tuple[int, float]:
  """(last step, its loss) from the run's metrics.jsonl (rollout rows carry no loss); with
  `step`, that step's."""
  found, loss = 0, float('nan')
  for row in _metric_rows(run_dir):
    if 'loss' in row and row.get('step', 0) >= found and (step is None or row['step'] == step):
      found, loss = int(row['step']), float(row['loss'])
  return found, loss


def best_checkpoint(run_dir: str) -> str:
  """The step directory of the RL run's best validation reward (val_reward rows; the later of
  equal ones), or the latest checkpoint when the run logged none."""
  scored = [r for r in _metric_rows(run_dir) if 'val_reward' in r]
  if not scored:
    return run_dir
  best = max(scored, key=lambda r: (r['val_reward'], r['step']))['step']
  path = os.path.join(run_dir, 'checkpoints', str(best))
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{run_dir}: the best validation reward is at step {best}, but '
                            f'{path} was not kept; set checkpoint.every to eval.every and '
                            'checkpoint.keep to at least the number of evaluations.')
  return path


def evaluate_stage(run_dir: str, task: str, *, num: int = EVAL_EXAMPLES, sampling=None,
                   samples: int = 1) -> dict:
  """Held-out accuracy and mean reward of the run's latest checkpoint (evaluate.tasks_mode)."""
  from dlmjax import evaluate  # pylint: disable=import-outside-toplevel
  model = evaluate.EvalModel(run_dir, sampling=sampling or eval_sampling(), seed=EVAL_SEED,
                             batch_size=EVAL_BATCH)
  _, summary = evaluate.tasks_mode(model, [task], num=num, seed=EVAL_SEED, samples=samples)
  return summary[task]


def verify_stage(run_dir: str) -> tuple[bool, str]:
  """dlmjax.verify's integrity and fp32 parity checks; (all passed, the report)."""
  from dlmjax import verify  # pylint: disable=import-outside-toplevel
  checks = verify.verify(run_dir)
  return all(c.ok for c in checks), verify.report(checks)


def run_seed(seed: int, output_dir: str, task: str, recipe=None, log=print) -> list[dict]:
  """Trains the three stages of one seed, then evaluates and verifies each; one row per stage."""
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  recipe = recipe or recipe_for('d1', task)
  run_dir = os.path.join(output_dir, f'seed{seed}')
  configs = stage_configs(seed, run_dir, task, recipe)
  write_sft_set(configs['sft'].sft.train_file, task)
  rows, start = [], time.time()
  for stage in STAGES:
    log(f'== seed {seed}: {stage} -> {configs[stage].output_dir}')
    stage_start = time.time()
    loop.train(configs[stage])
    steps = final_loss(configs[stage].output_dir)[0]
    if steps < configs[stage].train.steps:  # a stop signal checkpointed it early
      raise InterruptedError(f'seed {seed}: {stage} stopped at step {steps} of '
                             f'{configs[stage].train.steps}; the same command resumes it.')
    rows.append(dict(seed=seed, stage=stage, train_s=time.time() - stage_start))
  for row in rows:
    run = configs[row['stage']].output_dir
    stage_start = time.time()
    stage_dir = best_checkpoint(run) if row['stage'] == 'rl' else run
    chosen = None if stage_dir == run else int(os.path.basename(stage_dir))
    row['steps'], row['loss'] = final_loss(run, chosen)
    scores = evaluate_stage(stage_dir, task, sampling=eval_sampling(recipe))
    row.update(accuracy=scores['accuracy'], mean_reward=scores['mean_reward'],
               eval_examples=scores['examples'])
    if chosen is not None:  # what the last checkpoint scores, for comparison
      last = final_loss(run)[0]
      row['final'] = dict(step=last, **(scores if chosen == last else evaluate_stage(
          run, task, sampling=eval_sampling(recipe))))
    ok, report = verify_stage(stage_dir)
    row['verify'] = ok
    row['eval_s'] = time.time() - stage_start
    log(f'seed {seed} {row["stage"]}: accuracy {row["accuracy"]:.3f}, mean reward '
        f'{row["mean_reward"]:.3f}, verify {"PASS" if ok else "FAIL"}')
    if not ok:
      log(report)
  rows[-1]['seed_wall_s'] = time.time() - start
  return rows


# ----------------------------------------------------------------------------------------------
# Table


def _std(values) -> float:
  """Sample standard deviation (ddof=1): the spread a new seed would show; 0 for one seed."""
  values = np.asarray(values, np.float64)
  return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def aggregate(rows: list[dict]) -> dict:
  """Mean and std over seeds per stage, and RL's gain over SFT against the seed-to-seed spread.

  The gain of a metric is mean(RL) - mean(SFT); the spread is the larger of the two stages'
  sample stds over seeds; `beats_noise` says gain > spread. The paired per-seed gains are given
  too, with their std and t statistic (mean / (std / sqrt(seeds))): whether RL moves each
  seed's own model, which the between-seed spread of the models does not say."""
  if not rows:
    raise ValueError('no result rows to aggregate.')
  seeds = sorted({r['seed'] for r in rows})
  by = {(r['seed'], r['stage']): r for r in rows}
  stages = [s for s in STAGES if any(r['stage'] == s for r in rows)]
  summary = {}
  for stage in stages:
    missing = [s for s in seeds if (s, stage) not in by]
    if missing:
      raise ValueError(f'stage {stage} has no result for seeds {missing}.')
    entry = {}
    for metric in ('steps', 'loss', 'accuracy', 'mean_reward'):
      values = [by[(s, stage)][metric] for s in seeds]
      entry[metric] = dict(mean=float(np.mean(values)), std=_std(values))
    entry['verify'] = all(by[(s, stage)]['verify'] for s in seeds)
    summary[stage] = entry
  gain = {}
  if 'sft' in summary and 'rl' in summary:
    for metric in ('accuracy', 'mean_reward'):
      paired = [by[(s, 'rl')][metric] - by[(s, 'sft')][metric] for s in seeds]
      spread = max(summary['sft'][metric]['std'], summary['rl'][metric]['std'])
      delta = summary['rl'][metric]['mean'] - summary['sft'][metric]['mean']
      paired_std = _std(paired)
      paired_t = delta / (paired_std / np.sqrt(len(seeds))) if paired_std > 0 else None
      gain[metric] = dict(gain=delta, spread=spread, paired=paired, paired_std=paired_std,
                          paired_t=paired_t, beats_noise=bool(delta > spread))
  return dict(seeds=seeds, stages=summary, rl_gain=gain)


def format_table(rows: list[dict], summary: dict) -> str:
  head = (f'{"seed":>6} {"stage":<9} {"steps":>5} {"loss":>9} {"accuracy":>15} '
          f'{"mean reward":>15}  verify')
  lines = [head, '-' * len(head)]
  for r in sorted(rows, key=lambda r: (r['seed'], STAGES.index(r['stage']))):
    lines.append(f'{r["seed"]:>6} {r["stage"]:<9} {r["steps"]:>5} {r["loss"]:>9.4f} '
                 f'{r["accuracy"]:>15.3f} {r["mean_reward"]:>15.3f}  '
                 f'{"PASS" if r["verify"] else "FAIL"}')
  lines.append('-' * len(head))
  for stage, e in summary['stages'].items():
    lines.append(f'{"mean":>6} {stage:<9} {e["steps"]["mean"]:>5.0f} {e["loss"]["mean"]:>9.4f} '
                 f'{_pm(e["accuracy"]):>15} {_pm(e["mean_reward"]):>15}  '
                 f'{"PASS" if e["verify"] else "FAIL"}')
  chosen = [r for r in sorted(rows, key=lambda r: r['seed']) if 'final' in r]
  if chosen:
    lines.append('rl rows: the checkpoint of best validation reward (train-split problems outside '
                 'the RL prompts); the last checkpoint scored ' + ', '.join(
                     f'{r["final"]["mean_reward"]:.3f} (seed {r["seed"]}, step '
                     f'{r["final"]["step"]})' for r in chosen))
  walls = [f'seed {r["seed"]} {r["seed_wall_s"] / 60:.1f} min' for r in rows if 'seed_wall_s' in r]
  if walls:
    lines.append('wall time (train + evaluate + verify): ' + ', '.join(walls))
  for metric, g in summary['rl_gain'].items():
    verdict = 'beats' if g['beats_noise'] else 'does NOT beat'
    paired = ', '.join(f'{p:+.3f}' for p in g['paired'])
    lines.append(f'RL gain over SFT in {metric}: {g["gain"]:+.3f} (per seed {paired}); '
                 f'seed-to-seed spread (std) {g["spread"]:.3f}: {verdict} the noise')
    if g.get('paired_t') is not None:
      lines.append(f'  paired per seed: {g["gain"]:+.3f} +- {g["paired_std"]:.3f}, '
                   f't {g["paired_t"]:.1f} over {len(g["paired"])} seeds')
  return '\n'.join(lines)


def _pm(stat: dict) -> str:
  return f'{stat["mean"]:.3f}+-{stat["std"]:.3f}'


# ----------------------------------------------------------------------------------------------
# CLI


def parse_seeds(text: str) -> list[int]:
  parts = [p.strip() for p in text.split(',')]
  if not text.strip() or not all(parts):
    raise ValueError(f'--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2.')
  try:
    seeds = [int(p) for p in parts]
  except ValueError:
    raise ValueError(f'--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2.'
                     ) from None
  if len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f'--seeds {text!r}: seeds must be distinct and non-negative.')
  return seeds


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='python -m dlmjax.demo', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated, e.g. 0,1,2')
  parser.add_argument('--output-dir', default='runs/demo')
  parser.add_argument('--objective', default='d1', help='the RL stage: d1 | espo | spg (its '
                      'own run directory rl_<objective>; pre-training and SFT are shared)')
  parser.add_argument('--task', default='arithmetic', help='one of TASK_CANVAS: arithmetic '
                      '(where RL beats the noise), sudoku4, countdown3, countdown4 (each with '
                      'its canvas)')
  return parser


def main(argv=None) -> int:
  from dlmjax import cli  # pylint: disable=import-outside-toplevel
  from dlmjax import tasks as tasks_lib  # pylint: disable=import-outside-toplevel
  args = _parser().parse_args(argv)
  try:
    seeds = parse_seeds(args.seeds)
    if args.task not in tasks_lib.TASKS:
      raise ValueError(f'--task {args.task!r}: choose one of {sorted(tasks_lib.TASKS)}.')
    recipe = recipe_for(args.objective, args.task)
    os.makedirs(args.output_dir, exist_ok=True)
    start, rows = time.time(), []
    for seed in seeds:
      rows += run_seed(seed, args.output_dir, args.task, recipe)
    summary = aggregate(rows)
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  wall_s = time.time() - start
  table = format_table(rows, summary)
  print(table)
  print(f'wall time {wall_s / 60:.1f} min for {len(seeds)} seed(s)')
  result = dict(task=args.task, objective=args.objective, seeds=seeds, recipe=recipe,
                eval_examples=EVAL_EXAMPLES, wall_s=wall_s, rows=rows, summary=summary,
                table=table)
  name = 'results.json' if args.objective == 'd1' else f'results_{args.objective}.json'
  with open(os.path.join(args.output_dir, name), 'w') as f:
    json.dump(result, f, indent=2)
  return 0


if __name__ == '__main__':
  sys.exit(main())
