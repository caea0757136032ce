"""What a run reports: metrics.jsonl rows and a console line (step, loss, tok/s, MFU, ETA)."""

from __future__ import annotations

import json
import os
import sys
import time

import jax

from dlmjax.observability import progress
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.observability import plots as plots_lib
from dlmjax.observability import sinks as sinks_lib
from dlmjax.train import completion

SPIKE_FRACTION = 0.2  # Megatron's SPIKY_LOSS_PERC

# Dense bf16 peak per device, for MFU (peak_tflops=0: from the device kind).
_PEAK_TFLOPS = {'H200': 989.0, 'H100': 989.0, 'A100': 312.0, 'B200': 2250.0, 'GH200': 989.0}


def peak_flops_per_device(configured_tflops: float) -> float:
  if configured_tflops > 0:
    return configured_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in _PEAK_TFLOPS.items():
    if name in kind:
      return tflops * 1e12
  return 0.0  # unknown (e.g. CPU): MFU is not reported.


class Reporter:
  """Turns per-step device metrics into throughput figures, a jsonl row and a console line."""

  def __init__(
    self,
    run_dir: str,
    *,
    total_steps: int,
    flops_per_token: int,
    peak_tflops: float,
    sinks=(),
    console_metrics=(),
    flag_spikes: bool = True,
  ):
    """console_metrics: the stage's metrics the console line shows after the loss;
    flag_spikes: whether the stage's loss gets MegaDLMs' 20% spike rule (Stage.flag_spikes)."""
    self.total_steps = total_steps
    self.console_metrics, self.flag_spikes = tuple(console_metrics), flag_spikes
    self.sinks = list(sinks)  # dlmjax.observability.sinks: TensorBoard, W&B
    # Between logged lines, a progress bar on a terminal (never in log files).
    self._bar = progress.Bar(
      total_steps,
      'train',
      stream=sys.stdout,
      enabled=jax.process_index() == 0 and progress.is_tty(sys.stdout),
    )
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops_per_device(peak_tflops) * jax.device_count()
    self.is_writer = jax.process_index() == 0
    self.path = os.path.join(run_dir, 'metrics.jsonl')
    self._last_time = None
    self._last_step = None
    self._tokens_since = 0.0
    self.completion = completion.CompletionTimes()  # the loop watches each dispatched step
    self.started = time.time()
    self.skipped_total = 0
    self.consecutive_skips = 0
    self.loss_spikes = 0
    self._last_loss = None
    self.latest: tuple[int, dict] | None = None
    self.tokens_total, self.first_loss, self.final_loss = 0.0, None, None
    self._side = {}  # the latest values of rows written beside the steps' (a rollout's timings)

  def start(self, step: int) -> None:
    """Starts the throughput clock after `step`: a row for it or an earlier step (the first step,
    which includes compilation) reports no tokens/s, MFU or ETA."""
    self._last_time, self._last_step, self._tokens_since = time.time(), step, 0.0

  def watch(self, step: int, metrics) -> None:
    """Times the step just dispatched: its row's window ends when its metrics are ready
    (train/completion.py), not when the loop gets round to reading them."""
    self.completion.watch(step, metrics)

  def record(self, step: int, metrics: dict, *, write: bool) -> dict | None:
    """Accumulates tokens; when `write`, returns (and logs) the row for `step`.

    A timed row's window runs from the end of the last timed row's step to the end of its own
    (their completion times when watched, else the time of the read), so tokens/s is the
    speed of the steps in it, a save's blocked time included in the step after the save.
    """
    ended = self.completion.pop(step)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    self.latest = (step, metrics)  # what the divergence watch reads after each record
    timed = step > self._last_step  # steps up to the clock's start ran before it (compilation)
    self.tokens_total += metrics['tokens']
    if not metrics['skipped']:
      self.first_loss = metrics['loss'] if self.first_loss is None else self.first_loss
      self.final_loss = metrics['loss']
    if timed:
      self._tokens_since += metrics['tokens']
    if metrics['skipped']:
      self.skipped_total += 1
      self.consecutive_skips += 1
      if self.is_writer:
        print(
          f'step {step}: loss {metrics["loss"]} / grad norm {metrics["grad_norm"]} is not '
          f'finite; update skipped ({self.consecutive_skips} in a row)',
          flush=True,
        )
    else:
      self.consecutive_skips = 0
      self._check_spike(step, metrics['loss'])
    if not write:
      self._bar.update(step, f'loss {metrics["loss"]:.4f}')
      return None
    self._bar.clear()
    row = dict(step=step, **metrics, skipped_total=self.skipped_total, loss_spikes=self.loss_spikes)
    if timed:
      now = time.time() if ended is None else ended
      start, since, tokens = self._last_time, self._last_step, self._tokens_since
      elapsed = max(now - start, 1e-9)
      row['tokens_per_s'] = tokens / elapsed
      row['step_time_s'] = elapsed / (step - since)
      if self.peak_flops:
        row['mfu'] = row['tokens_per_s'] * self.flops_per_token / self.peak_flops
      self._last_time, self._last_step, self._tokens_since = now, step, 0.0
    row.update(device_memory())
    self.write_row(row)
    if self.is_writer:
      print(self._line(row), flush=True)
    return row

  def write_row(self, row: dict) -> None:
    """Appends a row ({'step': n, name: float, ...}) to metrics.jsonl and every sink; stages and
    evaluations log extra metrics (val_loss, reward stats) through this too."""
    self._side.update({k: v for k, v in row.items() if k in self.console_metrics})
    if not self.is_writer:
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
    for sink in self.sinks:
      sink.write(int(row['step']), row)

  def close(self) -> None:
    self.completion.close()
    self._bar.close()
    for sink in self.sinks:
      sink.close()
    self.sinks = []

  def _check_spike(self, step: int, loss: float) -> None:
    """MegaDLMs' spiky-loss rule: a rise (loss - last) / last >= 20% is flagged (logged, not
    fatal); a drop is progress, never a spike."""
    last, self._last_loss = self._last_loss, loss
    if not self.flag_spikes or last is None or last <= 0:
      return
    if (loss - last) / last < SPIKE_FRACTION:
      return
    self.loss_spikes += 1
    if self.is_writer:
      print(
        f'step {step}: loss spike {last:.4f} -> {loss:.4f} ({100 * (loss - last) / last:+.0f}%)',
        flush=True,
      )

  def _line(self, row) -> str:
    parts = [f'step {row["step"]}/{self.total_steps}', f'loss {row["loss"]:.4f}']
    for name in self.console_metrics:  # from this step's row, else the latest side row
      value = row.get(name, self._side.get(name))
      if value is None:
        continue
      # Seconds (generate_s, step_time_s) read as 'generate 12.3s'.
      parts.append(f'{name[:-2]} {value:.2f}s' if name.endswith('_s') else f'{name} {value:.4f}')
    parts += [f'lr {row["lr"]:.2e}', f'grad_norm {row["grad_norm"]:.3f}']
    if 'tokens_per_s' not in row:  # the step that compiled: its time says nothing of speed
      return ' | '.join(parts)
    parts.append(f'{row["tokens_per_s"]:,.0f} tok/s')
    if 'mfu' in row:
      parts.append(f'MFU {100 * row["mfu"]:.1f}%')
    eta = row['step_time_s'] * (self.total_steps - row['step'])
    parts.append(f'ETA {_duration(eta)}')
    return ' | '.join(parts)

  def summary(self, step: int, *, run_dir: str, saved_step: int | None, outputs) -> str:
    """The run's closing lines: how far it got, and where everything it wrote is."""
    head = f'done: {step}/{self.total_steps} steps'
    if self.first_loss is not None:
      head += f', loss {self.first_loss:.4f} -> {self.final_loss:.4f}'
    lines = [f'{head}, {self.tokens_total:,.0f} tokens in {_duration(time.time() - self.started)}']
    if saved_step is not None:
      lines.append(
        f'  checkpoint   {os.path.join(run_dir, run_dir_lib.CHECKPOINT_DIR, str(saved_step))}'
      )
    lines.append(f'  metrics      {self.path}')
    if 'plots' in outputs:
      lines.append(f'  plots        {os.path.join(run_dir, plots_lib.PLOTS_DIR)}')
    if 'tensorboard' in outputs:
      lines.append(
        f'  tensorboard  tensorboard --logdir {os.path.join(run_dir, sinks_lib.TENSORBOARD_DIR)}'
      )
    if step < self.total_steps:
      lines.append(f'  resume       the same command continues from step {saved_step}')
    else:
      lines.append('  continue     the same command with a larger --config.train.steps')
    name = os.path.basename(os.path.normpath(run_dir))
    export = f'python -m dlmjax.convert to-hf --checkpoint-path {run_dir} --output-dir hf/{name}'
    lines.append(f'  export       {export}')
    return '\n'.join(lines)


def device_memory() -> dict[str, float]:
  """GiB in use and at peak on the first local device, where the backend reports it (GPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  out = {}
  if 'bytes_in_use' in stats:
    out['memory_gib'] = stats['bytes_in_use'] / 2**30
  if 'peak_bytes_in_use' in stats:
    out['peak_memory_gib'] = stats['peak_bytes_in_use'] / 2**30
  return out


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  if seconds >= 3600:
    return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
  return f'{seconds // 60}m{seconds % 60:02d}s'
