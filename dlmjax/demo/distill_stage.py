"""The demo's fourth stage (--distill): the SFT model, frozen, decodes train problems as teacher
rows; a student distils from them; teacher and student are tabled per decoding setting."""

from __future__ import annotations

import copy
import dataclasses
import os

from dlmjax import config as config_lib
from dlmjax import decoding_table
from dlmjax import distill as distill_cli
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.demo import routes, runs, sets
from dlmjax.diffusion import distill as distill_objectives
from dlmjax.train import loop

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
  teacher,
  path,
  sampling,
  task,
  *,
  num=TEACHER_ROWS,
  batch_size=runs.EVAL_BATCH,
  keep='all',
  retries=0,
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


def decoding_rows(models: dict, task, settings, *, num=sets.EVAL_EXAMPLES, log=print) -> list[dict]:
  """decoding_table's rows of {name: run_dir} (the teacher first) on the held-out problems."""

  def evaluate_fn(run_dir, sampling):
    return runs.evaluate_stage(run_dir, task, sampling=sampling, num=num)

  def measure_fn(run_dir, sampling):
    args = (evaluate_fn, run_dir, task, sampling, num)
    return decoding_table.measure(*args, seed=runs.EVAL_SEED, batch_size=runs.EVAL_BATCH)

  return decoding_table.measure_models(models, settings, measure_fn, log=log)


def run_distill(
  seed: int, output_dir: str, task: str, objective: str, log=print, *, keep: str = 'all'
) -> list[dict]:
  """The fourth stage of one seed (after run_seed): teacher rows (`keep`: every row, or the
  task's correct ones), the student, then teacher vs student per DISTILL_SETTINGS; one row per
  model and setting."""
  run_dir = os.path.join(output_dir, f'seed{seed}')
  configs = routes.stage_configs(seed, run_dir, task)
  sampling = routes.eval_sampling(configs['rl'])
  config = distill_config(configs['sft'], objective, run_dir, sampling, keep=keep)
  write_teacher_rows(config.init_from, config.sft.teacher_file, sampling, task, keep=keep)
  log(f'== seed {seed}: distill ({objective}) -> {config.output_dir}')
  loop.train(config)
  saved = run_dir_lib.resolve_step_dir(config.output_dir)[2]
  if saved < config.train.steps:
    raise InterruptedError(
      f'seed {seed}: distill stopped with its checkpoint at step {saved} of '
      f'{config.train.steps}; the same command resumes it from there.'
    )
  base = dataclasses.replace(sampling, threshold=0.0, factor=0.0)
  settings = decoding_table.settings_of(base, **DISTILL_SETTINGS)
  models = {'teacher': config.init_from, objective: config.output_dir}
  return [dict(row, seed=seed) for row in decoding_rows(models, task, settings, log=log)]
