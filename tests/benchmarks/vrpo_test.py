"""benchmarks/vrpo.py quality: the self-contained chain (pretrain -> SFT -> VRPO per LoRA rank and
seed) on the tiny model, its table against numpy, the skip of finished runs, and the GPU recipe's
configs (validated, not trained)."""

import argparse
import contextlib
import io
import json
import os

import numpy as np
import pytest

from benchmarks import vrpo
from dlmjax.checkpoint import manager as checkpoint_lib
from dlmjax.model import presets
from dlmjax.train import loop

# LoRA alone (full fine-tuning is the same chain, its config tested below): two seeds, a spread.
TINY = ['quality', '--tiny', '--seeds', '0,1', '--lora-ranks', '4']


def _result(out: str) -> dict:
  return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope='module')
def tiny_quality(tmp_path_factory):
  """One tiny run of the whole chain: (work dir, its stdout)."""
  work = str(tmp_path_factory.mktemp('vrpo_quality'))
  out = io.StringIO()  # a module fixture has no capsys
  with contextlib.redirect_stdout(out):
    assert vrpo.main([*TINY, '--work-dir', work]) == 0
  return work, out.getvalue()


def test_the_chain_trains_sft_then_vrpo_per_variant_and_seed(tiny_quality):
  work, out = tiny_quality
  result = _result(out)
  sft = os.path.join(work, 'sft')
  assert result['init_from'] == sft and result['preset'] == 'tiny'
  assert checkpoint_lib.resolve_step_dir(sft)[2] == vrpo.TINY_RECIPE['sft']['train.steps']
  assert list(result['per_seed']) == ['lora4']
  for row in result['per_seed']['lora4']:
    config = checkpoint_lib.load_run_config(os.path.join(work, 'vrpo_lora4', f'seed{row["seed"]}'))
    assert config.init_from == sft and config.seed == row['seed'] and config.stage == 'preference'
    assert (config.train.lora.rank, config.train.lora.alpha) == (4, 8.0)
  assert [r['seed'] for r in result['per_seed']['lora4']] == [0, 1]


def test_the_table_is_mean_and_sample_std_over_seeds(tiny_quality):
  result = _result(tiny_quality[1])
  for variant, rows in result['per_seed'].items():
    for key in vrpo.QUALITY_KEYS:
      values = np.array([r[key] for r in rows])
      got = result['summary'][variant][key]
      np.testing.assert_allclose(got['mean'], values.sum() / 2, rtol=1e-12)
      spread = np.sqrt(((values - values.mean()) ** 2).sum() / (len(values) - 1))
      np.testing.assert_allclose(got['std'], spread, rtol=1e-12, atol=1e-15)
      cell = f'{got["mean"]:.3f} +- {got["std"]:.3f}'
      assert any(
        line.startswith(f'| {variant} | 2 |') and cell in line
        for line in tiny_quality[1].splitlines()
      )


def test_a_rerun_trains_nothing_and_gives_the_same_table(tiny_quality, monkeypatch, capsys):
  work, out = tiny_quality
  monkeypatch.setattr(loop, 'train', lambda config: pytest.fail(f'retrained {config.output_dir}'))
  assert vrpo.main([*TINY, '--work-dir', work]) == 0
  assert _result(capsys.readouterr().out) == _result(out)


def test_a_stage_cut_by_a_signal_stops_the_chain(tmp_path, monkeypatch, capsys):
  trained = []
  monkeypatch.setattr(loop, 'train', trained.append)  # returns at once, as after a SIGTERM
  assert vrpo.main([*TINY, '--work-dir', str(tmp_path)]) == 3
  assert [c.output_dir for c in trained] == [str(tmp_path / 'pretrain')]
  err = capsys.readouterr().err.strip()
  assert (
    err
    == 'stopped: pretrain stopped before its first step; the same command resumes it from there.'
  )


def _args(**kw):
  base = dict(
    tiny=False,
    preset='qwen3_0p6b',
    task='arithmetic',
    work_dir='runs/q',
    init_from='',
    seeds='0,1,2',
    lora_ranks='0,16',
    override=[],
  )
  return argparse.Namespace(**(base | kw))


def test_the_gpu_recipe_is_the_presets_shape_in_the_builtin_tokenizer():
  configs = vrpo.quality_configs(_args(override=['lora16:train.lr=3e-3', 'sft:train.steps=700']))
  assert list(configs)[:3] == ['pretrain', 'sft', 'full/seed0'] and len(configs) == 2 + 6
  shape = presets.PRESETS['qwen3_0p6b']
  for config in configs.values():
    assert (config.model.num_layers, config.model.d_model) == (
      shape['num_layers'],
      shape['d_model'],
    )
    assert config.model.vocab_size == 4096 and config.model.mask_token_id == 3
    assert config.model.seq_len == 80 and config.model.dtype == 'bfloat16'
    assert config.checkpoint.keep == 1  # five 5.3 GB runs share a 64 GB disk
  assert configs['sft'].train.steps == 700 and configs['pretrain'].train.steps == 40
  assert configs['full/seed2'].train.lr == vrpo.GPU_RECIPE['vrpo']['train.lr']  # lora16's only
  plain = vrpo.quality_configs(_args(lora_ranks='0,16', seeds='0'))
  lora, full = plain['lora16/seed0'].train, plain['full/seed0'].train
  assert (lora.lr, lora.lora.rank, lora.lora.alpha) == (vrpo.LORA_LR_FACTOR * full.lr, 16, 32)
  assert full.lora.rank == 0 and full.lr == vrpo.GPU_RECIPE['vrpo']['train.lr']
  assert configs['lora16/seed1'].train.lr == 3e-3 and configs['lora16/seed1'].train.lora.rank == 16
  from_run = vrpo.quality_configs(_args(init_from='runs/mine', lora_ranks='16'))
  assert list(from_run) == ['lora16/seed0', 'lora16/seed1', 'lora16/seed2']
  assert {c.init_from for c in from_run.values()} == {'runs/mine'}


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--lora-ranks', '0,x'], "--lora-ranks '0,x': give distinct non-negative integers"),
    (['--seeds', '1,1'], "--seeds '1,1': seeds must be distinct"),
    (['--preset', 'nope'], "--preset 'nope': choose one of"),
    (['--override', 'vrpo:train.nope=1'], 'train.nope'),
  ],
)
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
  assert vrpo.main(['quality', '--work-dir', str(tmp_path), *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and message in err and '\n' not in err
  assert not os.listdir(tmp_path)  # refused before anything is written
