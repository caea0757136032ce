"""The reporter: metrics rows, skip counting and MegaDLMs' 20% loss-spike rule."""

import json
import os

from dlmjax.train import reporting


def _metrics(loss, skipped=0.0):
  return dict(loss=loss, masked_ce=loss, lr=1e-3, grad_norm=1.0, tokens=100.0, skipped=skipped)


def test_rows_skips_and_spikes(tmp_path, capsys):
  reporter = reporting.Reporter(str(tmp_path), total_steps=6, flops_per_token=10, peak_tflops=0)
  reporter.start(0)
  losses = [5.0, 4.5, 5.5, float('nan'), 5.4, 4.0]  # +22% spike at 3, skip at 4, -26% at 6
  for step, loss in enumerate(losses, start=1):
    reporter.record(step, _metrics(loss, skipped=float(loss != loss)), write=True)
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, 'metrics.jsonl'))]
  assert [r['step'] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r['loss_spikes'] for r in rows] == [0, 0, 1, 1, 1, 2]
  assert rows[-1]['skipped_total'] == 1 and reporter.consecutive_skips == 0
  assert rows[0]['tokens_per_s'] > 0 and 'mfu' not in rows[0]  # CPU: no known peak
  out = capsys.readouterr().out
  assert 'loss spike 4.5000 -> 5.5000 (+22%)' in out
  assert 'update skipped (1 in a row)' in out


def test_spike_rule_off_outside_pretraining(tmp_path, capsys):
  """An RL surrogate near zero swings by far more than 20%: not flagged when the stage says so."""
  reporter = reporting.Reporter(
    str(tmp_path), total_steps=3, flops_per_token=10, peak_tflops=0, flag_spikes=False
  )
  reporter.start(0)
  for step, loss in enumerate([1e-4, -2e-4, 3e-3], start=1):
    reporter.record(step, _metrics(loss), write=True)
  assert reporter.loss_spikes == 0 and 'loss spike' not in capsys.readouterr().out
