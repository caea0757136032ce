"""Pre-train (tiny) -> SFT through the same loop: init_from adopts the model, HF dirs work too."""

import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.train import loop
from tests import stage_configs
from tests.conftest import tiny_test_config

ROOT = os.path.join(os.path.dirname(__file__), '..', '..')


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """One real pre-training step (its compilation is most of this module's ~80 s of CPU)."""
  run_dir = tmp_path_factory.mktemp('pretrain')
  c = stage_configs.with_cache(
    tiny_test_config(
      **{
        'train.steps': 1,
        'train.warmup_steps': 0,
        'train.wsd_decay_steps': 1,
        'diffusion.varlen_prob': 0.0,
      }
    )
  )
  c.output_dir = str(run_dir)
  loop.train(c)
  return run_dir


@pytest.fixture(scope='module')
def train_file(tmp_path_factory):
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp('data') / 'sft.jsonl'
  rows = []
  for _ in range(40):
    a, b = rng.integers(0, 50, 2)
    rows.append(json.dumps({'prompt': f'{a}+{b}?', 'response': str(a + b)}))
  path.write_text('\n'.join(rows) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def sft_run(pretrained, train_file, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp('sft')
  # The train file doubles as the held-out file: val_loss at step 2 (the last) is logged.
  row = loop.train(
    stage_configs.sft_config(
      pretrained,
      run_dir,
      train_file,
      **{'sft.eval_file': train_file, 'eval.every': 2, 'eval.batches': 1},
    )
  )
  return run_dir, row


def _rows(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow  # ~80 s on 2 cores: it compiles the pre-training and the SFT step.
def test_sft_runs_from_a_pretrained_run_and_adopts_its_model(sft_run, pretrained):
  run_dir, last = sft_run
  rows = _rows(run_dir)
  val = [r for r in rows if 'val_loss' in r]
  rows = [r for r in rows if 'val_loss' not in r]
  assert [r['step'] for r in rows] == [1, 2] and last['step'] == 2
  for key in ('loss', 'masked_ce', 'mask_ratio', 'response_tokens', 'lr'):
    assert np.isfinite(rows[0][key]), key
  assert np.isfinite(rows[1]['tokens_per_s'])  # step 1 compiles: it reports no speed
  assert [r['step'] for r in val] == [2] and np.isfinite(val[0]['val_loss'])
  assert 0 < rows[0]['mask_ratio'] < 1
  saved = run_dir_lib.load_run_config(str(run_dir))
  source = run_dir_lib.load_run_config(str(pretrained))
  assert saved.stage == 'sft' and saved.sft.chat_template == 'plain'
  for key in ('num_layers', 'd_model', 'num_kv_heads', 'ffn_dim', 'seq_len', 'vocab_size'):
    assert saved.model[key] == source.model[key], key  # from the checkpoint, not the defaults
  _, step_dir, step = run_dir_lib.resolve_step_dir(str(run_dir))
  assert step == 2 and os.path.isdir(step_dir)


def test_init_from_a_hugging_face_export_adopts_its_model_and_weights(tmp_path, train_file):
  import jax  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import hf_io  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import init_from as init_from_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import run_model  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from tests.checkpoint import tiny_run  # pylint: disable=import-outside-toplevel

  source, params, _ = tiny_run.make_run(tmp_path / 'run')
  for path in (
    str(tmp_path / 'run'),
    hf_io.hf_from_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'hf'), dtype='fp32'),
  ):
    c = stage_configs.sft_config(path, tmp_path / 'sft', train_file, **{'model.dtype': 'bfloat16'})
    adopted = init_from_lib.adopt_source_config(c)
    assert 'model.d_model=64' in adopted and 'model.vocab_size=256' in adopted
    assert c.model.dtype == 'bfloat16'  # run-time knobs stay the config's
    setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
    restored = run_model.source_params(c, setup.mesh, purpose=None)
    tiny_run.assert_same_params(jax.device_get(restored), params)
    embedding = restored['embed_tokens']
    assert embedding.sharding == setup.param_shardings['embed_tokens']


def test_sft_needs_init_from(tmp_path, train_file):
  c = stage_configs.sft_config('', tmp_path, train_file)
  with pytest.raises(config_lib.ConfigError, match='set --config.init_from'):
    config_lib.validate(c)
  c.init_from = str(tmp_path / 'missing')
  with pytest.raises(config_lib.ConfigError, match='does not exist: train the model first'):
    loop.train(c)


def test_packing_is_the_data_key_and_leaves_padding_unsupervised():
  c = tiny_test_config(**{'stage': 'sft', 'data.packing': True, 'init_from': 'x'})
  config_lib.validate(c)
  with pytest.raises(config_lib.ConfigError, match='sft.packing is now data.packing'):
    config_lib.apply_overrides(c, {'sft.packing': True})
