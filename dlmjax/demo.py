"""python -m dlmjax.demo: pre-train -> SFT -> RL on the tiny model, each stage scored held-out.

  python -m dlmjax.demo [--seeds 0,1,2] [--output-dir runs/demo] [--task arithmetic]
                        [--objective d1|espo|spg|wd1|wd1pp|coupled_grpo] [--route rl|vrpo|reward]
                        [--pairs other|near_miss]
                        [--distill certainty|trajectory [--keep all|correct]]

Per seed, the three stages run through the normal trainer (`dlmjax.train.loop.train` on
configs/tiny.py, configs/sft.py and configs/rl.py with configs/demo.py's recipe on top), each
from the previous one's checkpoint. Every stage's checkpoint is then decoded greedily on the task's
held-out split with one sampler setting (dlmjax.evaluate's tasks mode) and checked with
dlmjax.verify; RL's is the one of best validation reward (train-split problems, every 10 steps).
The table gives per seed, then mean +- std over seeds: steps, final loss, held-out accuracy and
mean reward, and the RL gain over SFT against the seed-to-seed spread. It is also written to
OUTPUT_DIR/results.json (results_<objective>.json for the other objectives). A rerun resumes
finished or cut stages from their checkpoints; another --objective reuses the seeds' pre-training
and SFT runs and trains only its own RL stage (OUTPUT/seedN/rl_<objective>).

--distill OBJECTIVE adds a fourth stage per seed: the SFT model (the teacher, frozen) decodes
TEACHER_ROWS train problems (python -m dlmjax.distill), a student distils from it with
sft.objective=OBJECTIVE (OUTPUT/seedN/distill_<objective>), and a second table gives teacher vs
student per decoding setting (dlmjax/decoding_table.py: accuracy, tokens per forward, steps,
tokens/s, x none), as benchmarks/distill.py does on a larger model. With --keep correct the
student learns only from the teacher's rows the task judges correct (distill_<objective>_correct).

--route vrpo trains VRPO after SFT on the task's preference pairs (a worked solution over another
problem's); --route reward trains a reward model on them, then RL against it (rl.reward_model),
and reports the reward model's held-out pair accuracy before and after (docs/preference.md).
--pairs near_miss makes each pair's rejected response the problem's own worked solution with a
plausible wrong final answer (preference_rows.PAIR_KINDS), in its own runs (vrpo_near_miss, ...).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

import numpy as np

from dlmjax import cli
from dlmjax import config as config_lib
from dlmjax import decoding_table, evaluate
from dlmjax import distill as distill_cli
from dlmjax import tasks as tasks_lib
from dlmjax import verify
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.data import jsonl
from dlmjax.diffusion import distill as distill_objectives
from dlmjax.diffusion import sampler as sampler_lib
from dlmjax.train import loop, preference_rows, stages as stages_lib
from dlmjax.train import state as state_lib
from dlmjax.checkpoint import run_model
from dlmjax.parallel import mesh as mesh_lib

STAGES = ('pretrain', 'sft', 'rl')
# The routes after SFT (--route): RL on the task's reward; VRPO on the task's preference pairs;
# a reward model on those pairs, then RL against it (rl.reward_model). The reward model is no
# generator: it has no table row, its held-out pair accuracy before and after training is
# reported beside the table.
ROUTES = {
  'rl': STAGES,
  'vrpo': ('pretrain', 'sft', 'vrpo'),
  'reward': ('pretrain', 'sft', 'reward', 'rl'),
}
GENERATORS = ('pretrain', 'sft', 'vrpo', 'rl')  # the table's stages, in order
SFT_EXAMPLES = 4000  # task training examples written as the SFT set (worked solutions)
EVAL_EXAMPLES = 128  # held-out problems per stage and seed (the same ones for every stage)
EVAL_BATCH = 16
EVAL_SEED = 0  # held-out set and decoding key: fixed, so stages and seeds see the same problems
TEACHER_ROWS = 512  # train problems the teacher decodes for the distill stage
DISTILL_RECIPE = {  # dParallel's LLaDA recipe at this scale: a short fine-tune of the teacher
  'train.steps': 400,
  'train.lr': 1e-4,  # an SFT-ed model distils at a tenth of its SFT rate (dParallel: 2e-5, 8B)
  'train.min_lr': 1e-5,
  'train.warmup_steps': 20,
  'train.wsd_decay_steps': 40,
  'eval.every': 0,
}
# The distill stage's table: Fast-dLLM's threshold and dParallel's entropy rule, with and without
# the dual cache, and d3LLM's multi-block decoding (benchmarks/distill.py sweeps more).
DISTILL_SETTINGS = dict(
  thresholds=(0.9,), entropy_thresholds=(0.5,), caches=('none', 'dual'), block_add_thresholds=(0.1,)
)


def eval_sampling(rl_config):
  """Greedy decoding with the rollouts' sampler settings (canvas, gen length, steps, blocks)."""
  return dataclasses.replace(sampler_lib.SamplingConfig.from_config(rl_config), temperature=0.0)


# ----------------------------------------------------------------------------------------------
# Configs


def configs_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def base_config(path: str, overrides: dict):
  """The config file at `path` with dotted `overrides` on top (configs/demo.py's stages)."""
  return config_lib.apply_overrides(config_lib.load_file(path), overrides)


def config_spec(stage: str, task: str, objective: str = 'd1') -> str:
  """The config file and argument of one demo stage: configs/demo.py:STAGE,TASK,OBJECTIVE."""
  return f'{os.path.join(configs_dir(), "demo.py")}:{stage},{task},{objective}'


def route_stages(route: str) -> tuple[str, ...]:
  """The stages of a route (ROUTES), refusing an unknown one in one line."""
  if route not in ROUTES:
    raise ValueError(f'--route {route!r}: choose one of {sorted(ROUTES)}.')
  return ROUTES[route]


def stage_configs(
  seed: int, run_dir: str, task: str, objective: str = 'd1', route: str = 'rl', pairs: str = 'other'
) -> dict:
  """The stage configs of one seed and route (configs/demo.py's recipe): OUTPUT/seedN/{pretrain,
  sft, ...}, each after SFT from SFT; another objective's RL stage is OUTPUT/seedN/rl_<objective>,
  RL against the reward model rl_reward_model[_<objective>] (its rl.reward_model the seed's
  reward run). The preference stages read the task's pairs of kind `pairs` (write_pair_sets);
  a kind other than the default suffixes their run directories (vrpo_near_miss, ...)."""
  if not os.path.isdir(configs_dir()):
    raise FileNotFoundError(
      f'{configs_dir()} does not exist: the demo builds on the '
      "repository's configs/; run it from a source checkout of dlmjax."
    )
  stages = route_stages(route)
  suffix = pairs_suffix(pairs)
  rl_name = 'rl' if objective == 'd1' else f'rl_{objective}'
  if route == 'reward':
    rl_name = 'rl_reward_model' + ('' if objective == 'd1' else f'_{objective}') + suffix
  configs = {}
  for stage in stages:
    c = config_lib.load_file(config_spec(stage, task, objective))
    c.seed = seed
    name = stage + (suffix if stage in ('vrpo', 'reward') else '')
    c.output_dir = os.path.join(run_dir, rl_name if stage == 'rl' else name)
    c.log.outputs = ''
    if stage == 'sft':
      c.init_from = configs['pretrain'].output_dir
      c.sft.train_file = os.path.join(run_dir, f'sft_{task}.jsonl')
    elif stage != 'pretrain':
      c.init_from = configs['sft'].output_dir
    if stage in ('vrpo', 'reward'):
      c.preference.train_file, c.preference.eval_file = pair_files(run_dir, task, pairs)
    if stage == 'rl' and 'reward' in configs:
      c.rl.reward_model = configs['reward'].output_dir
    configs[stage] = c
  return configs


def pairs_suffix(pairs: str) -> str:
  """'' for the default pair kind, '_KIND' for another (its files' and runs' names)."""
  if pairs not in preference_rows.PAIR_KINDS:
    raise ValueError(f'--pairs {pairs!r}: choose one of {preference_rows.PAIR_KINDS}.')
  return '' if pairs == preference_rows.PAIR_KINDS[0] else f'_{pairs}'


def pair_files(run_dir: str, task: str, pairs: str = 'other') -> tuple[str, str]:
  """(train, held-out) preference pair files of a seed's run directory."""
  name = f'pairs_{task}{pairs_suffix(pairs)}'
  return tuple(os.path.join(run_dir, f'{name}_{split}.jsonl') for split in ('train', 'test'))


def write_pair_sets(
  run_dir: str, task: str, num: int = SFT_EXAMPLES, seed: int = 0, pairs: str = 'other'
) -> None:
  """The task's preference pairs of kind `pairs`: from its train split for training, its test
  split held out."""
  files = pair_files(run_dir, task, pairs)
  for path, split, count in zip(files, ('train', 'test'), (num, EVAL_EXAMPLES)):
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    jsonl.write_objects(path, preference_rows.task_pairs(task, split, count, seed, pairs))


def write_sft_set(path: str, task: str, num: int = SFT_EXAMPLES, seed: int = 0) -> str:
  """Worked solutions of the task's TRAIN split as SFT rows (the held-out split never enters)."""
  examples = tasks_lib.get_task(task).examples('train', num, seed)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  return jsonl.write_objects(path, [{'prompt': e.prompt, 'response': e.response} for e in examples])


def rows_suffix(keep: str = 'all', retries: int = 0) -> str:
  """'' for every teacher row on one try (the names of earlier runs), else what --keep and
  --retries chose, so that rows and students of another choice are not reused."""
  suffix = '' if keep == 'all' else f'_{keep}'
  return suffix + (f'_retries{retries}' if retries else '')


def distill_config(
  sft_config, objective: str, run_dir: str, sampling, teacher: str = '', *, keep='all', retries=0
):
  """The distill stage of one objective: the SFT config started from the teacher (the SFT run
  unless `teacher`), trained on its rows (RUN_DIR/teacher_rows<suffix>.npz, rows_suffix of
  `keep` and `retries`) with sft.objective and DISTILL_RECIPE, its sampler the eval sampler (the
  block it distils is the block it decodes)."""
  distill_objectives.get(objective)  # an unknown one fails naming the known ones
  suffix = rows_suffix(keep, retries)
  c = copy.deepcopy(sft_config)
  c.init_from = teacher or sft_config.output_dir
  c.output_dir = os.path.join(run_dir, f'distill_{objective}{suffix}')
  c.sft.objective = objective
  c.sft.train_file = ''  # it trains on the teacher's rows alone
  c.sft.teacher_file = os.path.join(run_dir, f'teacher_rows{suffix}.npz')
  config_lib.apply_overrides(c, DISTILL_RECIPE)
  keys = ('gen_length', 'steps', 'block_length')
  return config_lib.apply_overrides(c, {f'sampler.{k}': getattr(sampling, k) for k in keys})


def write_teacher_rows(
  teacher, path, sampling, task, *, num=TEACHER_ROWS, batch_size=EVAL_BATCH, keep='all', retries=0
):
  """The teacher's rows of `num` train problems (python -m dlmjax.distill, its --keep and
  --retries), unless written."""
  if os.path.isfile(path):
    return
  overrides = []
  keys = ('gen_length', 'steps', 'block_length', 'cache', 'threshold', 'factor', 'remasking')
  for key in keys + ('entropy_threshold', 'stop_at_eos'):
    overrides += ['--override', f'{key}={getattr(sampling, key)}']
  argv = ['--init-from', teacher, '--output', path, '--task', task]
  argv += ['--num', str(num), '--batch-size', str(batch_size)]
  argv += ['--keep', keep, '--retries', str(retries)]
  if distill_cli.main(argv + overrides):
    raise RuntimeError(f'no teacher rows in {path}: python -m dlmjax.distill failed (above).')


def decoding_rows(models: dict, task, settings, *, num=EVAL_EXAMPLES, log=print) -> list[dict]:
  """decoding_table's rows of {name: run_dir} (the teacher first) on the held-out problems."""

  def evaluate_fn(run_dir, sampling):
    return evaluate_stage(run_dir, task, sampling=sampling, num=num)

  def measure_fn(run_dir, sampling):
    args = (evaluate_fn, run_dir, task, sampling, num)
    return decoding_table.measure(*args, seed=EVAL_SEED, batch_size=EVAL_BATCH)

  return decoding_table.measure_models(models, settings, measure_fn, log=log)


def run_distill(
  seed: int, output_dir: str, task: str, objective: str, log=print, *, keep: str = 'all'
) -> list[dict]:
  """The fourth stage of one seed (after run_seed): teacher rows (`keep`: every row, or the
  task's correct ones), the student, then teacher vs student per DISTILL_SETTINGS; one row per
  model and setting."""
  run_dir = os.path.join(output_dir, f'seed{seed}')
  configs = stage_configs(seed, run_dir, task)
  sampling = eval_sampling(configs['rl'])
  config = distill_config(configs['sft'], objective, run_dir, sampling, keep=keep)
  write_teacher_rows(config.init_from, config.sft.teacher_file, sampling, task, keep=keep)
  log(f'== seed {seed}: distill ({objective}) -> {config.output_dir}')
  loop.train(config)
  saved = checkpoint_lib.resolve_step_dir(config.output_dir)[2]
  if saved < config.train.steps:
    raise InterruptedError(
      f'seed {seed}: distill stopped with its checkpoint at step {saved} of '
      f'{config.train.steps}; the same command resumes it from there.'
    )
  base = dataclasses.replace(sampling, threshold=0.0, factor=0.0)
  settings = decoding_table.settings_of(base, **DISTILL_SETTINGS)
  models = {'teacher': config.init_from, objective: config.output_dir}
  return [dict(row, seed=seed) for row in decoding_rows(models, task, settings, log=log)]


# ----------------------------------------------------------------------------------------------
# One seed


def metric_rows(run_dir: str) -> list[dict]:
  """The rows of a run's metrics.jsonl (for the demo's summaries and the benchmarks)."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def final_loss(run_dir: str, step: int | None = None) -> tuple[int, float]:
  """(last step, its loss) from the run's metrics.jsonl (rollout rows carry no loss); with
  `step`, that step's."""
  found, loss = 0, float('nan')
  for row in metric_rows(run_dir):
    if 'loss' in row and row.get('step', 0) >= found and (step is None or row['step'] == step):
      found, loss = int(row['step']), float(row['loss'])
  return found, loss


def best_checkpoint(run_dir: str) -> str:
  """The step directory of the RL run's best validation reward (val_reward rows; the later of
  equal ones), or the latest checkpoint when the run logged none."""
  scored = [r for r in metric_rows(run_dir) if 'val_reward' in r]
  if not scored:
    return run_dir
  best = max(scored, key=lambda r: (r['val_reward'], r['step']))['step']
  path = os.path.join(run_dir, 'checkpoints', str(best))
  if not os.path.isdir(path):
    raise FileNotFoundError(
      f'{run_dir}: the best validation reward is at step {best}, but '
      f'{path} was not kept; set checkpoint.every to eval.every and '
      'checkpoint.keep to at least the number of evaluations.'
    )
  return path


def evaluate_stage(
  run_dir: str, task: str, *, sampling, num: int = EVAL_EXAMPLES, samples: int = 1
) -> dict:
  """Held-out accuracy and mean reward of the run's latest checkpoint (evaluate.tasks_mode)."""
  model = evaluate.EvalModel(run_dir, sampling=sampling, seed=EVAL_SEED, batch_size=EVAL_BATCH)
  _, summary = evaluate.tasks_mode(model, [task], num=num, seed=EVAL_SEED, samples=samples)
  return summary[task]


def verify_stage(run_dir: str) -> tuple[bool, str]:
  """dlmjax.verify's integrity and fp32 parity checks; (all passed, the report)."""
  checks = verify.verify(run_dir)
  return all(c.ok for c in checks), verify.report(checks)


def reward_model_accuracy(config) -> dict:
  """A reward run's held-out pair accuracy and mean margin before training (the SFT model with
  the fresh head the run started from) and after: the loop's evaluation of its final step, or
  its last checkpoint scored when the run logged none. Both are whole models (a LoRA run's
  base with the head, or merged), so they are scored without adapters."""
  config = copy.deepcopy(config)
  config.train.lora.rank = 0
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  evaluator = stages_lib.build(config).evaluator(setup)
  margins = evaluator.margins(run_model.source_params(config, setup.mesh, purpose=None))
  out = dict(before=dict(accuracy=float((margins > 0).mean()), margin=float(margins.mean())))
  out['pairs'] = len(margins)
  scored = [r for r in metric_rows(config.output_dir) if 'val_reward_accuracy' in r]
  if scored and scored[-1]['step'] == config.train.steps:
    out['after'] = dict(accuracy=scored[-1]['val_reward_accuracy'], margin=scored[-1]['val_margin'])
  else:
    margins = evaluator.margins(run_model.restore(config.output_dir, setup.mesh).params)
    out['after'] = dict(accuracy=float((margins > 0).mean()), margin=float(margins.mean()))
  return out


def run_seed(
  seed: int,
  output_dir: str,
  task: str,
  objective: str = 'd1',
  log=print,
  route: str = 'rl',
  pairs: str = 'other',
) -> list[dict]:
  """Trains the stages of one seed's route, then evaluates and verifies each generator; one row
  per generator stage (a reward model's accuracy goes in the last row's `reward_model`)."""
  run_dir = os.path.join(output_dir, f'seed{seed}')
  configs = stage_configs(seed, run_dir, task, objective, route, pairs)
  sampling = eval_sampling(stage_configs(seed, run_dir, task, objective)['rl'])
  write_sft_set(configs['sft'].sft.train_file, task)
  if route != 'rl':
    write_pair_sets(run_dir, task, pairs=pairs)
  rows, start = [], time.time()
  for stage in configs:
    log(f'== seed {seed}: {stage} -> {configs[stage].output_dir}')
    stage_start = time.time()
    loop.train(configs[stage])
    saved = checkpoint_lib.resolve_step_dir(configs[stage].output_dir)[2]
    if saved < configs[stage].train.steps:  # a stop signal checkpointed it early
      raise InterruptedError(
        f'seed {seed}: {stage} stopped with its checkpoint at step {saved} of '
        f'{configs[stage].train.steps}; the same command resumes it from there.'
      )
    rows.append(dict(seed=seed, stage=stage, train_s=time.time() - stage_start))
  learned = None
  if 'reward' in configs:
    learned = reward_model_accuracy(configs['reward'])
    log(
      f'seed {seed} reward model: held-out pair accuracy {learned["before"]["accuracy"]:.3f} -> '
      f'{learned["after"]["accuracy"]:.3f} ({learned["pairs"]} pairs)'
    )
    rows = [r for r in rows if r['stage'] != 'reward']
  for row in rows:
    run = configs[row['stage']].output_dir
    stage_start = time.time()
    stage_dir = best_checkpoint(run) if row['stage'] == 'rl' else run
    chosen = None if stage_dir == run else int(os.path.basename(stage_dir))
    row['steps'], row['loss'] = final_loss(run, chosen)
    scores = evaluate_stage(stage_dir, task, sampling=sampling)
    row.update(
      accuracy=scores['accuracy'],
      mean_reward=scores['mean_reward'],
      eval_examples=scores['examples'],
    )
    if chosen is not None:  # what the last checkpoint scores, for comparison
      last = final_loss(run)[0]
      row['final'] = dict(
        step=last, **(scores if chosen == last else evaluate_stage(run, task, sampling=sampling))
      )
    ok, report = verify_stage(stage_dir)
    row['verify'] = ok
    row['eval_s'] = time.time() - stage_start
    log(
      f'seed {seed} {row["stage"]}: accuracy {row["accuracy"]:.3f}, mean reward '
      f'{row["mean_reward"]:.3f}, verify {"PASS" if ok else "FAIL"}'
    )
    if not ok:
      log(report)
  rows[-1]['seed_wall_s'] = time.time() - start
  if learned is not None:
    rows[-1]['reward_model'] = learned
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
  stages = [s for s in GENERATORS if any(r['stage'] == s for r in rows)]
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
  final = stages[-1]  # RL's, or VRPO's (the preference route)
  if 'sft' in summary and final not in ('pretrain', 'sft'):
    for metric in ('accuracy', 'mean_reward'):
      paired = [by[(s, final)][metric] - by[(s, 'sft')][metric] for s in seeds]
      spread = max(summary['sft'][metric]['std'], summary[final][metric]['std'])
      delta = summary[final][metric]['mean'] - summary['sft'][metric]['mean']
      paired_std = _std(paired)
      paired_t = delta / (paired_std / np.sqrt(len(seeds))) if paired_std > 0 else None
      gain[metric] = dict(
        gain=delta,
        spread=spread,
        paired=paired,
        paired_std=paired_std,
        paired_t=paired_t,
        beats_noise=bool(delta > spread),
      )
  # rl_gain: the final stage's gain over SFT (the key is RL's; the preference route's is VRPO's)
  return dict(seeds=seeds, stages=summary, rl_gain=gain, final_stage=final)


def format_table(rows: list[dict], summary: dict) -> str:
  head = (
    f'{"seed":>6} {"stage":<9} {"steps":>5} {"loss":>9} {"accuracy":>15} '
    f'{"mean reward":>15}  verify'
  )
  lines = [head, '-' * len(head)]
  for r in sorted(rows, key=lambda r: (r['seed'], GENERATORS.index(r['stage']))):
    lines.append(
      f'{r["seed"]:>6} {r["stage"]:<9} {r["steps"]:>5} {r["loss"]:>9.4f} '
      f'{r["accuracy"]:>15.3f} {r["mean_reward"]:>15.3f}  '
      f'{"PASS" if r["verify"] else "FAIL"}'
    )
  lines.append('-' * len(head))
  for stage, e in summary['stages'].items():
    lines.append(
      f'{"mean":>6} {stage:<9} {e["steps"]["mean"]:>5.0f} {e["loss"]["mean"]:>9.4f} '
      f'{_pm(e["accuracy"]):>15} {_pm(e["mean_reward"]):>15}  '
      f'{"PASS" if e["verify"] else "FAIL"}'
    )
  chosen = [r for r in sorted(rows, key=lambda r: r['seed']) if 'final' in r]
  if chosen:
    lines.append(
      'rl rows: the checkpoint of best validation reward (train-split problems outside '
      'the RL prompts); the last checkpoint scored '
      + ', '.join(
        f'{r["final"]["mean_reward"]:.3f} (seed {r["seed"]}, step {r["final"]["step"]})'
        for r in chosen
      )
    )
  walls = [f'seed {r["seed"]} {r["seed_wall_s"] / 60:.1f} min' for r in rows if 'seed_wall_s' in r]
  if walls:
    lines.append('wall time (train + evaluate + verify): ' + ', '.join(walls))
  for r in sorted(rows, key=lambda r: r['seed']):
    if 'reward_model' in r:
      m = r['reward_model']
      lines.append(
        f'reward model (seed {r["seed"]}): held-out pair accuracy {m["before"]["accuracy"]:.3f} '
        f'before, {m["after"]["accuracy"]:.3f} after (margin {m["before"]["margin"]:+.3f} -> '
        f'{m["after"]["margin"]:+.3f}, {m["pairs"]} pairs)'
      )
  final = summary.get('final_stage', 'rl').upper()
  for metric, g in summary['rl_gain'].items():
    verdict = 'beats' if g['beats_noise'] else 'does NOT beat'
    paired = ', '.join(f'{p:+.3f}' for p in g['paired'])
    lines.append(
      f'{final} gain over SFT in {metric}: {g["gain"]:+.3f} (per seed {paired}); '
      f'seed-to-seed spread (std) {g["spread"]:.3f}: {verdict} the noise'
    )
    if g.get('paired_t') is not None:
      lines.append(
        f'  paired per seed: {g["gain"]:+.3f} +- {g["paired_std"]:.3f}, '
        f't {g["paired_t"]:.1f} over {len(g["paired"])} seeds'
      )
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
    raise ValueError(
      f'--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2.'
    ) from None
  if len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f'--seeds {text!r}: seeds must be distinct and non-negative.')
  return seeds


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.demo',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated, e.g. 0,1,2')
  parser.add_argument('--output-dir', default='runs/demo')
  parser.add_argument(
    '--objective',
    default='d1',
    help='the RL stage: d1 | espo | spg | wd1 | wd1pp | coupled_grpo (its '
    'own run directory rl_<objective>; pre-training and SFT are shared)',
  )
  parser.add_argument(
    '--route',
    default='rl',
    help="after SFT: rl (the task reward) | vrpo (SFT -> VRPO on the task's preference pairs) | "
    'reward (SFT -> a reward model on those pairs -> RL against it)',
  )
  parser.add_argument(
    '--pairs',
    default='other',
    help="the preference routes' rejected responses: other (another problem's solution) | "
    "near_miss (the problem's own solution with a plausible wrong final answer)",
  )
  parser.add_argument(
    '--task',
    default='arithmetic',
    help='arithmetic (where RL beats the '
    'noise), sudoku4, countdown3 or countdown4, each with its canvas '
    '(configs/demo.py, TASK_CANVAS)',
  )
  parser.add_argument(
    '--distill',
    default='',
    help='a fourth stage: distil the SFT model with this sft.objective (certainty | '
    'trajectory) and table teacher vs student per decoding setting',
  )
  parser.add_argument(
    '--keep',
    choices=distill_cli.KEEP,
    default='all',
    help="--distill's teacher rows: all, or only those the task judges correct (dParallel)",
  )
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    seeds = parse_seeds(args.seeds)
    if args.task not in tasks_lib.TASKS:
      raise ValueError(f'--task {args.task!r}: choose one of {sorted(tasks_lib.TASKS)}.')
    # refuses bad input
    stage_configs(seeds[0], args.output_dir, args.task, args.objective, args.route, args.pairs)
    if args.distill:
      distill_objectives.get(args.distill)
    os.makedirs(args.output_dir, exist_ok=True)
    start, rows, distilled = time.time(), [], []
    for seed in seeds:
      rows += run_seed(
        seed, args.output_dir, args.task, args.objective, route=args.route, pairs=args.pairs
      )
      if args.distill:
        distilled += run_distill(seed, args.output_dir, args.task, args.distill, keep=args.keep)
    summary = aggregate(rows)
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  wall_s = time.time() - start
  table = format_table(rows, summary)
  print(table)
  for seed in seeds if distilled else ():
    mine = [r for r in distilled if r['seed'] == seed]
    print(f'seed {seed}: distill ({args.distill}), {EVAL_EXAMPLES} held-out problems')
    print(decoding_table.table(mine))
    print(decoding_table.verdict(mine))
  print(f'wall time {wall_s / 60:.1f} min for {len(seeds)} seed(s)')
  configs = {
    stage: os.path.relpath(config_spec(stage, args.task, args.objective))
    for stage in route_stages(args.route)
  }
  result = dict(
    task=args.task,
    objective=args.objective,
    route=args.route,
    pairs=args.pairs,
    seeds=seeds,
    configs=configs,
    eval_examples=EVAL_EXAMPLES,
    wall_s=wall_s,
    rows=rows,
    summary=summary,
    table=table,
    distill=dict(objective=args.distill, rows=distilled) if args.distill else None,
  )
  tag = args.objective if args.route == 'rl' else f'{args.route}_{args.objective}'
  tag += pairs_suffix(args.pairs) if args.route != 'rl' else ''
  name = 'results.json' if tag == 'd1' else f'results_{tag}.json'
  with open(os.path.join(args.output_dir, name), 'w') as f:
    json.dump(result, f, indent=2)
  return 0


if __name__ == '__main__':
  sys.exit(main())
