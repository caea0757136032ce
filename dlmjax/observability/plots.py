"""Loss, throughput and reward PNGs from a run's metrics.jsonl (`python -m dlmjax.plot` runs it).

Reads only the run's metrics.jsonl, so it works on a copied run directory without JAX devices.
Training draws the same plots into OUTPUT_DIR/plots at the end of a run (log.plots).
"""

from __future__ import annotations

import json
import math
import os
import sys

PLOTS_DIR = 'plots'
# figure -> the metrics it draws (each only if some row has it); 'reward' also takes any key that
# starts with "reward" (RL stages log reward_mean, reward_std, ...).
FIGURES = {
  'loss': ('loss', 'masked_ce', 'val_loss'),
  'throughput': ('tokens_per_s', 'mfu'),
  'reward': ('val_reward',),
  # MoE runs (model/moe.py): router losses, entropy, busiest and idlest experts' load x E.
  'router': ('moe_balance_loss', 'moe_z_loss', 'moe_entropy', 'moe_load_max', 'moe_load_min'),
}


class PlotError(ValueError):
  """A run directory without readable metrics, or matplotlib missing."""


def read_metrics(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise PlotError(
      f'{path} does not exist: RUN_DIR must be a dlmjax run directory (the training output_dir).'
    )
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        # A run killed mid-write leaves a partial last line; anything else is worth a warning.
        print(f'warning: {path}:{number} is not JSON; skipped', file=sys.stderr)
  return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of one metric; a resumed run's repeated steps keep their last value."""
  by_step = {}
  for row in rows:
    value = row.get(key)
    if isinstance(value, (int, float)) and math.isfinite(value):
      by_step[int(row['step'])] = float(value)
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def _figure_keys(rows: list[dict]) -> dict[str, list[str]]:
  present = {k for row in rows for k in row}
  keys = {name: [k for k in wanted if k in present] for name, wanted in FIGURES.items()}
  keys['reward'] = sorted(k for k in present if k.startswith('reward'))
  return {name: ks for name, ks in keys.items() if ks}


def draw(run_dir: str, out_dir: str | None = None) -> list[str]:
  """Writes <figure>.png for each figure with data; returns the paths written."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use('Agg')
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise PlotError('plots need matplotlib: `pip install "dlmjax[plot]"`.') from e
  rows = read_metrics(run_dir)
  out_dir = out_dir or os.path.join(run_dir, PLOTS_DIR)
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for name, keys in _figure_keys(rows).items():
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
      ax.plot(*series(rows, key), linewidth=1)
      ax.set_ylabel(key)
      ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel('step')
    fig.suptitle(f'{os.path.basename(os.path.abspath(run_dir))}: {name}')
    fig.tight_layout()
    path = os.path.join(out_dir, f'{name}.png')
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written
