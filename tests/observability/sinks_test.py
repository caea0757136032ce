"""Rows reach TensorBoard and (a fake) Weights & Biases through the Reporter."""

import json
import os
import sys
import types

import pytest

from dlmjax import config as config_lib
from dlmjax.observability import sinks, tensorboard
from dlmjax.train import reporting
from tests.conftest import tiny_test_config


class _FakeWandb(types.ModuleType):
  def __init__(self):
    super().__init__('wandb')
    self.runs = []

  def init(self, **kwargs):
    run = types.SimpleNamespace(kwargs=kwargs, logged=[], finished=False)
    run.log = lambda values, step: run.logged.append((step, values))
    run.finish = lambda: setattr(run, 'finished', True)
    self.runs.append(run)
    return run


def _config(outputs='tensorboard,plots'):
  return tiny_test_config(**{'log.outputs': outputs})


def test_reporter_rows_reach_every_sink(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, 'wandb', fake)
  monkeypatch.setenv('WANDB_PROJECT', 'proj')
  config = _config('tensorboard,wandb')
  reporter = reporting.Reporter(
    str(tmp_path),
    total_steps=3,
    flops_per_token=10,
    peak_tflops=0.0,
    sinks=sinks.make_sinks(config, str(tmp_path)),
  )
  reporter.start(0)
  metrics = dict(
    skipped=0.0,
    loss=2.5,
    masked_ce=2.0,
    mask_ratio=0.5,
    real_input_length=8.0,
    tokens=100.0,
    grad_norm=1.5,
    lr=1e-3,
  )
  reporter.record(1, metrics, write=True)
  reporter.write_row({'step': 1, 'val_loss': 3.25, 'reward_mean': 0.5})
  reporter.close()
  (run,) = fake.runs
  assert run.kwargs['mode'] == 'offline' and run.kwargs['project'] == 'proj'
  assert run.kwargs['dir'] == str(tmp_path) and run.finished
  assert [step for step, _ in run.logged] == [1, 1]
  assert run.logged[0][1]['loss'] == 2.5 and 'step' not in run.logged[0][1]
  assert run.logged[1][1] == {'val_loss': 3.25, 'reward_mean': 0.5}
  (name,) = os.listdir(tmp_path / sinks.TENSORBOARD_DIR)
  scalars = tensorboard.read_scalars(str(tmp_path / sinks.TENSORBOARD_DIR / name))
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  for row in rows:
    for key, value in row.items():
      if key != 'step':
        assert (row['step'], pytest.approx(value, rel=1e-6)) in scalars[key]
  assert scalars['tokens_per_s'][0][1] > 0


def test_missing_wandb_is_a_clear_config_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # makes `import wandb` raise ImportError
  with pytest.raises(config_lib.ConfigError, match='pip install wandb'):
    sinks.make_sinks(_config('wandb'), str(tmp_path))


def test_sinks_follow_the_config(tmp_path):
  assert sinks.make_sinks(_config('plots'), str(tmp_path)) == []
  (sink,) = sinks.make_sinks(_config(), str(tmp_path))
  assert isinstance(sink, sinks.TensorBoardSink)
  sink.close()
