"""Validation loss: logged by the loop at eval.every, fixed masks, equal to a hand-written loss."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.data import pipeline
from dlmjax.diffusion import masking
from dlmjax.train import loop, stages
from tests.conftest import tiny_test_config


def _config(output_dir):
  c = tiny_test_config(
    **{
      'train.steps': 4,
      'eval.every': 2,
      'eval.batches': 1,
      'model.num_layers': 1,
      'train.warmup_steps': 1,
      'train.wsd_decay_steps': 1,
      'checkpoint.every': 0,
      'log.outputs': '',
    }
  )
  c.output_dir = str(output_dir)
  if os.environ.get('DLMJAX_CACHE_DIR'):
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return c


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp('eval_run')
  config = _config(run_dir)
  made = []
  pretrain = stages.BUILDERS['pretrain']

  def capture(config):
    stage = pretrain(config)
    return dataclasses.replace(
      stage, evaluator=lambda setup: made.append(stage.evaluator(setup)) or made[-1]
    )

  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(stages.BUILDERS, 'pretrain', capture)
    loop.train(config)
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return config, rows, made[0]


def test_loop_logs_validation_rows(run):
  _, rows, _ = run
  val = [r for r in rows if 'val_loss' in r]
  assert [r['step'] for r in val] == [2, 4]
  for r in val:
    assert np.isfinite(r['val_loss']) and r['val_masked_ce'] > 0
  assert val[1]['val_loss'] < val[0]['val_loss']  # the same masks: only the model moved
  assert [r['step'] for r in rows if 'loss' in r] == [1, 2, 3, 4]


def test_validation_loss_is_fixed_and_equals_a_hand_written_loss(run):
  config, rows, evaluator = run
  _, step_dir, _ = run_dir_lib.resolve_step_dir(config.output_dir)
  params = params_checkpoint.restore_params(
    step_dir, *model_lib.param_placement(config, evaluator.setup.mesh)
  )
  again = evaluator.run(4, params)
  logged = [r for r in rows if r.get('step') == 4 and 'val_loss' in r][0]
  # Evaluating the saved step-4 params again scores exactly what the loop logged.
  assert again['val_loss'] == pytest.approx(logged['val_loss'], rel=1e-6)

  # By hand: mask with example_keys(config.EVAL_SEED, step 0, example index), full length, numpy CE.
  tokens = next(pipeline.make_batch_iterator(config, split='valid'))['tokens']
  x = tokens[:, :-1]
  keys = masking.example_keys(config_lib.EVAL_SEED, 0, np.arange(x.shape[0]))
  noisy, masked, p = masking.forward_process(
    keys, x, mask_id=config.model.mask_token_id, length=x.shape[1]
  )
  cfg = model_lib.ModelConfig.from_config(config)
  logits = np.asarray(
    jax.jit(lambda p_, t: model_lib.merge(cfg, p_)(t))(jax.device_get(params), noisy), np.float64
  )
  logits -= logits.max(-1, keepdims=True)
  ce = np.log(np.exp(logits).sum(-1)) - np.take_along_axis(logits, x[..., None], -1)[..., 0]
  masked = np.asarray(masked)
  want_loss = np.sum(ce * masked / np.asarray(p)[:, None]) / x.size
  want_ce = np.sum(ce * masked) / masked.sum()
  assert again['val_loss'] == pytest.approx(want_loss, rel=1e-4)
  assert again['val_masked_ce'] == pytest.approx(want_ce, rel=1e-4)


def test_bad_eval_settings(tiny_config):
  tiny_config.eval.batches = 0
  tiny_config.eval.every = 5
  with pytest.raises(config_lib.ConfigError, match='eval.batches'):
    config_lib.validate(tiny_config)
  tiny_config.eval.batches = 1
  tiny_config.eval.every = -1
  with pytest.raises(config_lib.ConfigError, match='eval.every'):
    config_lib.validate(tiny_config)
