"""One seed of the demo: its route's stages trained in turn, then each generator scored on the
task's held-out problems and verified; and the readers of a run's metrics the scoring uses."""

from __future__ import annotations

import copy
import json
import os
import time

from dlmjax import evaluate, verify
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import run_model
from dlmjax.demo import routes, sets
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import loop, stages as stages_lib
from dlmjax.train import state as state_lib

EVAL_BATCH = 16
EVAL_SEED = 0  # held-out set and decoding key: fixed, so stages and seeds see the same problems


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
  run_dir: str, task: str, *, sampling, num: int = sets.EVAL_EXAMPLES, samples: int = 1
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
  out = dict(before=_ranked(margins), pairs=len(margins))
  scored = [r for r in metric_rows(config.output_dir) if 'val_reward_accuracy' in r]
  if scored and scored[-1]['step'] == config.train.steps:
    out['after'] = dict(accuracy=scored[-1]['val_reward_accuracy'], margin=scored[-1]['val_margin'])
  else:
    out['after'] = _ranked(
      evaluator.margins(run_model.restore(config.output_dir, setup.mesh).params)
    )
  return out


def _ranked(margins) -> dict:
  """Held-out pairs' reward margins as the share ranked right and the mean margin."""
  return dict(accuracy=float((margins > 0).mean()), margin=float(margins.mean()))


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
  configs = routes.stage_configs(seed, run_dir, task, objective, route, pairs)
  sampling = routes.eval_sampling(routes.stage_configs(seed, run_dir, task, objective)['rl'])
  sets.write_sft_set(configs['sft'].sft.train_file, task)
  if route != 'rl':
    sets.write_pair_sets(run_dir, task, pairs=pairs)
  rows, start = [], time.time()
  for stage in configs:
    log(f'== seed {seed}: {stage} -> {configs[stage].output_dir}')
    stage_start = time.time()
    loop.train(configs[stage])
    saved = run_dir_lib.resolve_step_dir(configs[stage].output_dir)[2]
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
