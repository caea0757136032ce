"""The demo's result table: per seed and stage, mean +- std over seeds, and the final stage's gain
over SFT against the seed-to-seed spread."""

from __future__ import annotations

import numpy as np

from dlmjax.demo import routes


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
  stages = [s for s in routes.GENERATORS if any(r['stage'] == s for r in rows)]
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
  for r in sorted(rows, key=lambda r: (r['seed'], routes.GENERATORS.index(r['stage']))):
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
