"""benchmarks/vrpo.py quality: the self-contained chain (pretrain -> SFT -> VRPO and a reward model
per LoRA rank and seed) on the tiny model, its tables against numpy, the skip of finished runs,
and the GPU recipe's configs (validated, not trained)."""

import argparse
import contextlib
import io
import json
import os

import numpy as np
import pytest

from benchmarks import vrpo
from dlmjax.checkpoint import run_dir as run_dir_lib
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


def test_the_chain_trains_sft_then_vrpo_and_a_reward_model_per_variant_and_seed(tiny_quality):
  work, out = tiny_quality
  result = _result(out)
  sft = os.path.join(work, 'sft')
  assert result['init_from'] == sft and result['preset'] == 'tiny' and result['pairs'] == 'other'
  assert run_dir_lib.resolve_step_dir(sft)[2] == vrpo.TINY_RECIPE['sft']['train.steps']
  assert list(result['per_seed']) == ['lora4', 'reward_lora4']
  for variant, stage in (('lora4', 'preference'), ('reward_lora4', 'reward')):
    assert [r['seed'] for r in result['per_seed'][variant]] == [0, 1]
    for row in result['per_seed'][variant]:
      run = os.path.join(work, f'{stage.replace("preference", "vrpo")}_lora4', f'seed{row["seed"]}')
      config = run_dir_lib.load_run_config(run)
      assert config.init_from == sft and config.seed == row['seed'] and config.stage == stage
      assert (config.train.lora.rank, config.train.lora.alpha) == (4, 8.0)
      assert config.preference.train_file == os.path.join(work, 'pairs_arithmetic_train.jsonl')
      # The figures are kept beside the run; its checkpoints went once they were.
      assert not os.path.exists(os.path.join(run, 'checkpoints'))
      with open(os.path.join(run, vrpo.FIGURES)) as f:
        assert json.load(f) == row


def test_the_reward_models_figures_are_its_held_out_accuracy_before_and_after(tiny_quality):
  """After: the reward run's own last held-out evaluation; before: the SFT model with the run's
  fresh head, scored on the same held-out pairs."""
  work, out = tiny_quality
  for row in _result(out)['per_seed']['reward_lora4']:
    run = os.path.join(work, 'reward_lora4', f'seed{row["seed"]}')
    with open(os.path.join(run, 'metrics.jsonl')) as f:
      last = [r for r in map(json.loads, f) if 'val_reward_accuracy' in r][-1]
    assert last['step'] == row['step'] == vrpo.TINY_RECIPE['reward']['train.steps']
    assert (row['val_reward_accuracy'], row['val_margin']) == (
      last['val_reward_accuracy'],
      last['val_margin'],
    )
    held_out = vrpo.TINY_RECIPE['']['train.global_batch_size']  # eval.batches 1
    assert row['pairs'] == last['val_pairs'] == held_out
    accuracy = row['reward_accuracy_before'] * row['pairs']
    assert abs(accuracy - round(accuracy)) < 1e-9  # a share of the held-out pairs


def test_the_table_is_mean_and_sample_std_over_seeds(tiny_quality):
  result = _result(tiny_quality[1])
  for variant, rows in result['per_seed'].items():
    keys = vrpo.REWARD_KEYS if variant.startswith('reward_') else vrpo.QUALITY_KEYS
    assert list(result['summary'][variant]) == list(keys)
    for key in keys:
      values = np.array([r[key] for r in rows])
      got = result['summary'][variant][key]
      np.testing.assert_allclose(got['mean'], values.sum() / 2, rtol=1e-12)
      spread = np.sqrt(((values - values.mean()) ** 2).sum() / (len(values) - 1))
      np.testing.assert_allclose(got['std'], spread, rtol=1e-12, atol=1e-15)
      cell = f'{got["mean"]:.3f} +- {got["std"]:.3f}'
      assert any(
        line.startswith(f'| {variant.removeprefix("reward_")} | 2 |') and cell in line
        for line in tiny_quality[1].splitlines()
      )
  assert '| reward model | seeds | before: reward accuracy' in tiny_quality[1]


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
    pairs='other',
  )
  return argparse.Namespace(**(base | kw))


def test_the_gpu_recipe_is_the_presets_shape_in_the_builtin_tokenizer():
  configs = vrpo.quality_configs(
    _args(override=['lora16:train.lr=3e-3', 'sft:train.steps=700', 'reward_full:train.lr=2e-4'])
  )
  assert list(configs)[:4] == ['pretrain', 'sft', 'full/seed0', 'reward_full/seed0']
  assert len(configs) == 2 + 12
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
  # The reward runs: configs/reward.py's rate (x10 for LoRA), VRPO's size, the SFT run's model.
  reward, reward_lora = plain['reward_full/seed0'], plain['reward_lora16/seed0']
  assert reward.stage == 'reward' and reward.init_from == configs['sft'].output_dir
  assert (reward.train.steps, reward.train.global_batch_size) == (
    full.steps,
    full.global_batch_size,
  )
  assert reward.train.lr == vrpo.GPU_RECIPE['reward']['train.lr'] and reward.eval.batches == 8
  assert reward_lora.train.lr == vrpo.LORA_LR_FACTOR * reward.train.lr
  assert reward_lora.train.lora.rank == 16 and configs['reward_full/seed1'].train.lr == 2e-4
  assert configs['full/seed1'].train.lr == vrpo.GPU_RECIPE['vrpo']['train.lr']
  from_run = vrpo.quality_configs(_args(init_from='runs/mine', lora_ranks='16'))
  assert list(from_run) == [f'{s}lora16/seed{i}' for i in range(3) for s in ('', 'reward_')]
  assert {c.init_from for c in from_run.values()} == {'runs/mine'}


def test_near_miss_pairs_get_runs_of_their_own():
  near = vrpo.quality_configs(_args(pairs='near_miss', seeds='0'))
  plain = vrpo.quality_configs(_args(seeds='0'))
  assert near['sft'].output_dir == plain['sft'].output_dir  # one SFT model for both kinds
  for name in ('full/seed0', 'reward_lora16/seed0'):
    stage = 'reward' if name.startswith('reward') else 'vrpo'
    variant = name.split('/')[0].removeprefix('reward_')
    assert near[name].output_dir == f'runs/q/{stage}_{variant}_near_miss/seed0'
    assert near[name].preference.train_file == 'runs/q/pairs_arithmetic_near_miss_train.jsonl'
    assert plain[name].output_dir == f'runs/q/{stage}_{variant}/seed0'


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--lora-ranks', '0,x'], "--lora-ranks '0,x': give distinct non-negative integers"),
    (['--seeds', '1,1'], "--seeds '1,1': seeds must be distinct"),
    (['--preset', 'nope'], "--preset 'nope': choose one of"),
    (['--override', 'vrpo:train.nope=1'], 'train.nope'),
    (['--pairs', 'hard'], "--pairs 'hard': choose one of"),
  ],
)
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
  assert vrpo.main(['quality', '--work-dir', str(tmp_path), *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and message in err and '\n' not in err
  assert not os.listdir(tmp_path)  # refused before anything is written
