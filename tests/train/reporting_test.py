"""The reporter: metrics rows, skip counting and MegaDLMs' 20% loss-spike rule."""

import json
import os

from dlmjax.train import reporting


def _metrics(loss, skipped=0.0):
  return dict(loss=loss, masked_ce=loss, lr=1e-3, grad_norm=1.0, tokens=100.0, skipped=skipped)


def test_rows_skips_and_spikes(tmp_path, capsys):
  reporter = reporting.Reporter(str(tmp_path), total_steps=6, flops_per_token=10, peak_tflops=0)
  reporter.start(0)
  losses = [5.0, 4.5, 5.5, float('nan'), 5.4, 4.0]  # +22% spike at 3, skip at 4, -26% drop at 6
  for step, loss in enumerate(losses, start=1):
    reporter.record(step, _metrics(loss, skipped=float(loss != loss)), write=True)
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, 'metrics.jsonl'))]
  assert [r['step'] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r['loss_spikes'] for r in rows] == [0, 0, 1, 1, 1, 1]  # a drop is no spike
  assert rows[-1]['skipped_total'] == 1 and reporter.consecutive_skips == 0
  assert rows[0]['tokens_per_s'] > 0 and 'mfu' not in rows[0]  # CPU: no known peak
  out = capsys.readouterr().out
  assert 'loss spike 4.5000 -> 5.5000 (+22%)' in out and '5.4000 -> 4.0000' not in out
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


def test_the_compiling_step_reports_no_speed(tmp_path, capsys, monkeypatch):
  """The loop restarts the clock after step 1 (compilation): step 1's row has its loss but no
  tokens/s, MFU or ETA; step 2's speed is its tokens over the time since step 1 ended."""
  reporter = reporting.Reporter(str(tmp_path), total_steps=12, flops_per_token=10, peak_tflops=1)
  clock = iter([0.0, 50.0, 53.0])  # start(0); start(1) after compiling; step 2 read back
  monkeypatch.setattr(reporting.time, 'time', lambda: next(clock))
  reporter.start(0)
  reporter.start(1)
  first = reporter.record(1, _metrics(5.0), write=True)
  second = reporter.record(2, _metrics(4.0), write=True)
  assert 'tokens_per_s' not in first and 'mfu' not in first
  assert second['tokens_per_s'] == 100.0 / 3.0 and second['step_time_s'] == 3.0
  peak = 1e12 * reporting.jax.device_count()
  assert second['mfu'] == second['tokens_per_s'] * 10 / peak
  lines = capsys.readouterr().out.strip().split('\n')
  assert lines[0] == 'step 1/12 | loss 5.0000 | lr 1.00e-03 | grad_norm 1.000'
  assert lines[1].endswith('| 33 tok/s | MFU 0.0% | ETA 0m30s')  # 3 s x 10 steps left


def test_rows_are_timed_by_when_their_steps_finished_not_when_they_are_read(tmp_path, monkeypatch):
  """On a GPU the loop reads a step's metrics back a whole step late (the next dispatch returns
  near that step's end), and the last row with nothing behind it (the H200 printed 99,840 tok/s
  for 52k steps). Rows are timed by their steps' completion times instead: every 10 s step reads
  10 tok/s, the last one too."""
  reporter = reporting.Reporter(str(tmp_path), total_steps=4, flops_per_token=10, peak_tflops=0)
  # start(1) at 0; then the reads, a step late: rows 2, 3 at 20 and 30, the last at 30.5.
  reads = iter([0.0, 20.0, 30.0, 30.5])
  monkeypatch.setattr(reporting.time, 'time', lambda: next(reads))
  ended = {2: 10.0, 3: 20.0, 4: 30.0}  # what the waiter saw
  monkeypatch.setattr(reporter.completion, 'pop', lambda step: ended.get(step))
  reporter.start(1)
  reporter.record(1, _metrics(5.0), write=True)
  rows = [reporter.record(s, _metrics(4.0), write=True) for s in (2, 3, 4)]
  assert [r['tokens_per_s'] for r in rows] == [10.0, 10.0, 10.0]
  assert [r['step_time_s'] for r in rows] == [10.0, 10.0, 10.0]


def test_completion_times_are_when_the_outputs_became_ready():
  import jax
  import jax.numpy as jnp

  from dlmjax.train import completion

  times = completion.CompletionTimes()
  slow = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64))
  x = jnp.eye(256) * 1.0001
  slow(x).block_until_ready()  # compiled
  before = reporting.time.time()
  out = slow(x)
  times.watch(7, out)
  ready = times.pop(7)
  assert before <= ready <= reporting.time.time()
  assert out.is_ready() and times.pop(7) is None  # each step is popped once; unwatched: None
  times.close()


def test_console_shows_side_rows_and_the_run_ends_with_a_summary(tmp_path, capsys):
  """RL's line carries the latest rollout's seconds (a row written beside the steps); the run's
  last lines say how far it got and where its checkpoint, metrics, plots and events are."""
  reporter = reporting.Reporter(
    str(tmp_path),
    total_steps=4,
    flops_per_token=10,
    peak_tflops=0,
    console_metrics=('reward_mean', 'generate_s', 'step_time_s'),
  )
  reporter.start(0)
  reporter.write_row({'step': 1, 'rollout': 0, 'generate_s': 12.345})
  reporter.record(1, dict(_metrics(0.5), reward_mean=0.25), write=True)
  reporter.record(2, dict(_metrics(0.25), reward_mean=0.75), write=True)
  line = capsys.readouterr().out.strip().split('\n')[-1]
  assert line.startswith(
    'step 2/4 | loss 0.2500 | reward_mean 0.7500 | generate 12.35s | step_time'
  )
  run = str(tmp_path)
  summary = reporter.summary(2, run_dir=run, saved_step=2, outputs=('tensorboard', 'plots'))
  lines = summary.split('\n')
  assert lines[0].startswith('done: 2/4 steps, loss 0.5000 -> 0.2500, 200 tokens in 0m0')
  assert f'  checkpoint   {run}/checkpoints/2' in lines
  assert f'  metrics      {run}/metrics.jsonl' in lines
  assert f'  plots        {run}/plots' in lines
  assert f'  tensorboard  tensorboard --logdir {run}/tensorboard' in lines
  assert '  resume       the same command continues from step 2' in lines
  assert lines[-1].endswith(f'to-hf --checkpoint-path {run} --output-dir hf/{tmp_path.name}')


def test_divergence_watch_flags_non_finite_steps_and_spikes_over_the_window():
  from dlmjax.train import divergence  # pylint: disable=import-outside-toplevel

  watch = divergence.DivergenceWatch(factor=2.0, window=3)
  assert [watch.observe(s, loss, False) for s, loss in enumerate([9.0, 3.0, 3.0], 1)] == [None] * 3
  assert watch.observe(4, 10.0, False) is None  # 10 < 2 x mean(9, 3, 3) = 10: no spike
  assert watch.observe(5, 10.0, False) is None  # window (3, 3, 10): mean 5.33, 2x = 10.7
  reason = watch.observe(6, 30.0, False)  # window (3, 10, 10): mean 7.67, 2x = 15.3
  assert reason == (
    'the loss 30.0000 is 3.9x the mean 7.6667 of the last 3 steps (train.spike_factor=2)'
  )
  assert watch.observe(7, 40.0, False) is None  # the same divergence goes on
  assert watch.observe(8, 9.0, False) is None  # healthy again: the divergence ended
  assert watch.observe(9, float('nan'), True).startswith('the loss nan or the gradient')
  watch.forget(10)
  assert watch.observe(10, float('nan'), True) is None  # ran on the discarded state
  off = divergence.DivergenceWatch(factor=2.0, window=3, check_spikes=False)
  assert [off.observe(s, loss, False) for s, loss in enumerate([1.0, 1.0, 1.0, 50.0])] == [None] * 4
  assert divergence.last_good_step([2, 4, 5, 6], diverged_at=6) == 4
  assert divergence.last_good_step([5, 6], diverged_at=6) is None
