"""The preference stage's config checks: each bad setting fails in one line naming the key; the
reference's start line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train.stages import preference
from tests import stage_configs
from tests.conftest import tiny_test_config


@pytest.mark.parametrize(
  'overrides, message',
  [
    ({'preference.budget': 0}, 'preference.budget=0 must be >= 1'),
    (
      {'preference.n_time': 3},
      'not a multiple of preference.n_time=3',
    ),
    ({'preference.beta': 0.0}, 'preference.beta=0.0 must be > 0'),
    ({'diffusion.objective': 'ar'}, 'diffusion.objective=mdm'),
    ({'rl.ref_sync_every': 4}, 'rl.ref_sync_every=0'),
  ],
)
def test_bad_settings_name_the_key(overrides, message):
  config = tiny_test_config(**{'stage': 'preference', **overrides})
  config_lib.validate(tiny_test_config(stage='preference'))  # the tiny config itself is fine
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)
  config.stage = 'sft'  # the preference.* keys are checked only where the stage reads them
  config.init_from = 'runs/sft'
  if not any(key.startswith(('diffusion.', 'rl.')) for key in overrides):
    config_lib.validate(config)


def test_a_run_needs_a_model_to_align():
  config = tiny_test_config(**{'stage': 'preference', 'init_from': ''})
  with pytest.raises(ValueError, match='set --config.init_from'):
    preference.check_files(config)


def test_the_file_setting_names_the_builtin_pair_kind(tmp_path):
  """builtin:near_miss (configs/vrpo.py:near_miss, configs/reward.py:near_miss) reads the
  near-miss pairs for training and, with eval_file unset, for the held-out pairs too; '' keeps
  the default kind; a data path is read as it is."""
  config = config_lib.load_file('configs/vrpo.py:near_miss')
  config.data.cache_dir = str(tmp_path)
  assert config.output_dir == 'runs/vrpo_near_miss'
  assert config_lib.load_file('configs/reward.py:lora,near_miss').preference.train_file == (
    'builtin:near_miss'
  )
  for split, path in (
    ('train', preference.train_file(config)),
    ('test', preference.eval_file(config)),
  ):
    assert path == preference.preference_rows.ensure_builtin_pairs(
      str(tmp_path), split=split, kind='near_miss'
    )
  config.preference.train_file = ''
  assert preference.eval_file(config) == preference.preference_rows.ensure_builtin_pairs(
    str(tmp_path), split='test'
  )
  config.preference.train_file = config.preference.eval_file = 'pairs.jsonl'
  assert preference.train_file(config) == preference.eval_file(config) == 'pairs.jsonl'
  config.preference.train_file = 'builtin:nope'
  with pytest.raises(ValueError, match="'builtin:nope': the built-in pairs are builtin:KIND"):
    preference.check_files(config)


def test_the_allocation_and_antithetic_switches_reach_the_estimator():
  config = tiny_test_config(**{'stage': 'preference', 'preference.budget': 6})
  assert preference.settings(config)['n_time'] == 6 and preference.settings(config)['n_mask'] == 1
  config.preference.n_time = 2
  assert (preference.settings(config)['n_time'], preference.settings(config)['n_mask']) == (2, 3)
  assert preference.reference_stream(config) == preference.vrpo.POLICY_STREAM
  config.preference.antithetic = False
  assert preference.reference_stream(config) != preference.vrpo.POLICY_STREAM


def test_the_start_line_names_vrpos_reference_not_a_kl_term(tmp_path, capsys):
  """The line printed when the reference is restored says what VRPO uses it for."""
  init = str(tmp_path / 'init')
  c = tiny_test_config(**{'model.seq_len': 96, 'output_dir': init})
  params = model_lib.init_params(model_lib.ModelConfig.from_config(c), jax.random.key(0))
  params_checkpoint.save_params_checkpoint(init, c, params)
  config = stage_configs.with_cache(
    tiny_test_config(**{'stage': 'preference', 'init_from': init, 'model.seq_len': 96})
  )
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  stages.build(config).evaluator(setup)
  out = capsys.readouterr().out
  assert 'frozen VRPO reference model (B_ref in the DPO loss) from' in out and 'KL' not in out


def test_the_reference_is_scored_a_micro_batch_at_a_time_with_the_whole_batchs_values():
  """The batch source's Scorer runs its program on micro-batch slices of the rows (the training
  step's activation size), and each row's draws are its own (its mask seed), so the slices give
  what one call over the whole batch gives."""
  config = tiny_test_config(
    **{
      'stage': 'preference',
      'preference.budget': 2,
      'train.global_batch_size': 4,
      'train.micro_batch_size': 2,
    }
  )
  cfg = model_lib.ModelConfig.from_config(config)
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  params = model_lib.init_params(cfg, jax.random.key(0))
  scorer = preference.Scorer(config, setup, cfg)
  program, rows = scorer.program, []

  def spy(params, tokens, *args):
    rows.append(len(tokens))
    return program(params, tokens, *args)

  scorer.program = spy
  batch = preference.stage(config).example_batch(np.random.default_rng(0))
  got = scorer(params, batch, preference.vrpo.POLICY_STREAM)
  assert len(batch['tokens']) == 4 and rows == [2, 2]
  keys = preference.vrpo.row_keys(config.seed, jnp.asarray(batch['mask_seeds']), 0)
  whole = program(params, batch['tokens'], batch['rejected'], batch['prompt_lengths'], keys)
  np.testing.assert_allclose(got, np.asarray(whole), rtol=1e-6, atol=1e-6)
