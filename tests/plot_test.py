"""python -m dlmjax.plot on a synthetic metrics.jsonl: which PNGs, what they draw, clear errors."""

import json

import numpy as np
import pytest

from dlmjax import plot
from dlmjax.observability import plots

pytest.importorskip('matplotlib')

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _write_rows(run_dir, rows):
  with open(run_dir / 'metrics.jsonl', 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')


def test_draws_loss_throughput_and_reward(tmp_path, capsys):
  rng = np.random.default_rng(0)
  rows = [
    dict(
      step=s,
      loss=float(rng.uniform(2, 8)),
      masked_ce=1.0,
      tokens_per_s=1e4,
      mfu=0.3,
      reward_mean=float(rng.uniform()),
      reward_std=0.1,
    )
    for s in range(1, 21)
  ]
  rows.append(dict(step=10, val_loss=4.0))
  _write_rows(tmp_path, rows)
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 21, "lo')  # a run killed mid-write
  assert plot.main([str(tmp_path)]) == 0
  written = capsys.readouterr().out.split()
  assert sorted(p.rsplit('/', 1)[1] for p in written) == [
    'loss.png',
    'reward.png',
    'throughput.png',
  ]
  for path in written:
    with open(path, 'rb') as f:
      assert f.read(8) == PNG_MAGIC
  # A resumed run logs some steps twice: the series keeps the last value per step.
  steps, values = plots.series(rows + [dict(step=3, loss=-1.0)], 'loss')
  assert steps == list(range(1, 21)) and values[2] == -1.0
  assert plots.series(rows, 'val_loss') == ([10], [4.0])


def test_no_reward_figure_without_reward_metrics(tmp_path):
  _write_rows(tmp_path, [dict(step=s, loss=1.0 / s, tokens_per_s=5.0) for s in range(1, 4)])
  written = plots.draw(str(tmp_path), str(tmp_path / 'out'))
  assert sorted(p.rsplit('/', 1)[1] for p in written) == ['loss.png', 'throughput.png']


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
  assert plot.main([str(tmp_path)]) == 2
  assert 'metrics.jsonl does not exist' in capsys.readouterr().err
