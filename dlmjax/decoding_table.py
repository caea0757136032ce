"""Trained models against each other per decoding setting: the distillation table.

For each model (a teacher and its distilled students) and each sampler setting (none; Fast-dLLM's
threshold; dParallel's entropy rule; each with a cache; d3LLM's multi-block decoding), on the
task's held-out problems:
accuracy (+- its standard error over the problems), tokens per forward (TPF: generated tokens /
decoding steps that committed any, from the sampler's commit-step record), steps per problem,
generated tokens/s, x the same model's `none` and x the teacher's `none`. One module so the demo's
distill stage and benchmarks/distill.py measure the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from dlmjax import distill as distill_cli
from dlmjax import inference
from dlmjax import tasks as tasks_lib


def settings_of(
  base, *, thresholds=(), entropy_thresholds=(), caches=('none',), block_add_thresholds=()
) -> dict:
  """{name: SamplingConfig} of every decoding setting, none first: per cache, the cache alone,
  each threshold and each entropy threshold; then d3LLM's multi-block decoding (uncached) at each
  block_add_threshold with each entropy threshold."""
  out = {'none': dataclasses.replace(base, cache='none')}
  for cache in caches:
    prefix = '' if cache == 'none' else f'{cache}+'
    if cache != 'none':
      out[cache] = dataclasses.replace(base, cache=cache)
    for t in thresholds:
      out[f'{prefix}threshold {t:g}'] = dataclasses.replace(base, cache=cache, threshold=t)
    for h in entropy_thresholds:
      out[f'{prefix}entropy {h:g}'] = dataclasses.replace(
        base, cache=cache, remasking='entropy', entropy_threshold=h
      )
  for a in block_add_thresholds:
    for h in entropy_thresholds:
      out[f'multi-block {a:g} entropy {h:g}'] = dataclasses.replace(
        base, cache='none', entropy_threshold=h, block_add_threshold=a, stop_at_eos=False
      )
  return {name: s.validate() for name, s in out.items()}


def steps_and_tpf(run_dir, task, sampling, num, *, seed, batch_size) -> tuple[float, float]:
  """(mean decoding steps per problem, generated tokens per step) of the held-out problems, from
  the sampler's commit-step record (the evaluation's problems, prompts and decoding key)."""
  pretrained = inference.load_pretrained(run_dir)
  examples = tasks_lib.get_task(task).examples('test', num, seed)
  prompts, _ = distill_cli.encode_prompts(
    pretrained, [e.prompt for e in examples], sampling.gen_length
  )
  rows = distill_cli.build_rows(pretrained, prompts, sampling, batch_size=batch_size, seed=seed)
  return tpf_of(rows['commit_steps'])


def tpf_of(commit_steps) -> tuple[float, float]:
  """(mean steps per row, tokens per step) of commit-step rows (-1: no generated token there)."""
  per_row = np.array([len(np.unique(s[s >= 0])) for s in commit_steps])
  return float(per_row.mean()), float((commit_steps >= 0).sum() / max(per_row.sum(), 1))


def measure(evaluate_fn, run_dir, task, sampling, num, *, seed, batch_size) -> dict:
  """One row's numbers; evaluate_fn(run_dir, sampling) -> {'accuracy', 'examples'} runs twice,
  the second time compiled, for its seconds."""
  evaluate_fn(run_dir, sampling)
  start = time.perf_counter()
  scores = evaluate_fn(run_dir, sampling)
  seconds = time.perf_counter() - start
  p, n = scores['accuracy'], scores['examples']
  steps, tpf = steps_and_tpf(run_dir, task, sampling, num, seed=seed, batch_size=batch_size)
  return dict(
    accuracy=p,
    accuracy_se=math.sqrt(p * (1 - p) / max(n, 1)),
    tpf=tpf,
    steps=steps,
    tokens_per_s=n * sampling.gen_length / seconds,
  )


def with_speedups(rows: list[dict]) -> list[dict]:
  """Adds x none (the row's model's `none`, its first row) and x teacher none (the first row)."""
  none = {}
  for r in rows:
    none.setdefault(r['model'], r['tokens_per_s'])
    r['speedup'] = r['tokens_per_s'] / none[r['model']]
    r['vs_teacher'] = r['tokens_per_s'] / rows[0]['tokens_per_s']
  return rows


def measure_models(models: dict, settings: dict, measure_fn, log=print) -> list[dict]:
  """Rows of every {name: run_dir} model (the teacher first) under every setting (none first);
  measure_fn(run_dir, sampling) -> measure's dict."""
  rows = []
  for model, run_dir in models.items():
    for name, sampling in settings.items():
      rows.append(dict(model=model, setting=name, **measure_fn(run_dir, sampling)))
      with_speedups(rows)
      log(rows[-1])
  return rows


def table(rows) -> str:
  head = ('model', 'setting', 'accuracy', 'TPF', 'steps', 'tokens/s', 'x none', 'x teacher none')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    lines.append(
      f'{r["model"]} | {r["setting"]} | {r["accuracy"]:.3f} +- {r["accuracy_se"]:.3f} | '
      f'{r["tpf"]:.2f} | {r["steps"]:.1f} | {r["tokens_per_s"]:.1f} | {r["speedup"]:.2f} | '
      f'{r["vs_teacher"]:.2f}'
    )
  return '\n'.join(lines)


def verdict(rows) -> str:
  """The issue's numbers: the student settings within 1 point of the teacher's none."""
  floor = rows[0]['accuracy'] - 0.01
  students = [r for r in rows if r['model'] != rows[0]['model']]
  if not students:
    return 'no student rows'
  kept = [r for r in students if r['accuracy'] >= floor]
  if not kept:
    best = max(students, key=lambda r: r['accuracy'])
    return (
      f'no student setting within 1 point of the teacher none ({rows[0]["accuracy"]:.3f}); the '
      f'most accurate: {best["model"]} {best["setting"]} {best["accuracy"]:.3f}'
    )
  by_tpf = max(kept, key=lambda r: r['tpf'])
  by_speed = max(kept, key=lambda r: r['vs_teacher'])
  return (
    f'within 1 point of the teacher none ({rows[0]["accuracy"]:.3f}): highest TPF '
    f'{by_tpf["tpf"]:.2f} ({by_tpf["model"]} {by_tpf["setting"]}, goal >= 4); fastest '
    f'{by_speed["vs_teacher"]:.2f}x teacher none ({by_speed["model"]} {by_speed["setting"]}, '
    'goal >= 8 with the dual cache)'
  )
