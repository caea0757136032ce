"""A LoRA run end to end: adapter-only checkpoints, exact resume, a changed base refused, and the
exports (merged model; PEFT adapter that peft loads onto the exported base) giving its logits."""

import contextlib
import io
import json
import os
import sys

import jax
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import convert
from dlmjax import model as model_lib
from dlmjax.checkpoint import lora_checkpoint, params_checkpoint, peft_io, run_model, step_meta
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.model import lora
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import loop
from dlmjax.train import state as state_lib
from tests.conftest import tiny_test_config

torch = pytest.importorskip('torch')
peft = pytest.importorskip('peft')


def _config(output_dir, **overrides):
  c = tiny_test_config(
    **{'train.steps': 4, 'checkpoint.every': 2, 'diffusion.varlen_prob': 0.0, **overrides}
  )
  c.output_dir = str(output_dir)
  if os.environ.get('DLMJAX_CACHE_DIR'):
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return c


def _lora(output_dir, base, **overrides):
  return _config(
    output_dir,
    **{
      'init_from': str(base),
      'train.lr': 0.05,
      'train.warmup_steps': 0,
      'train.schedule': 'constant',
      'train.lora.rank': 4,
      'train.lora.alpha': 8.0,
      'train.lora.targets': 'q,v,o,up,down',
      'train.lora.base_dtype': 'float32',
      'train.lora.dropout': 0.05,  # PEFT's default for d1: resume must redraw the same masks
      **overrides,
    },
  )


def _losses(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return {row['step']: row['loss'] for row in map(json.loads, f)}


_PRINTED = {}  # what the fixture's run printed


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  # The base: a params-only run directory (as an import writes) of a fresh init; a trained base
  # would cost a pre-training step's compile and prove nothing more here.
  base = tmp_path_factory.mktemp('base')
  config = _config(base)
  params = model_lib.init_params(model_lib.ModelConfig.from_config(config), jax.random.key(1))
  params_checkpoint.save_params_checkpoint(str(base), config, jax.device_get(params))
  straight = tmp_path_factory.mktemp('lora')
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    loop.train(_lora(straight, base))
  sys.stdout.write(printed.getvalue())
  _PRINTED['start'] = printed.getvalue()
  return base, straight


def test_the_start_line_counts_the_adapters_it_trains(runs):
  _, straight = runs
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(str(straight))
  _, adapters, _ = run_model.restore_lora(run_dir, step_dir, run_dir_lib.load_run_config(run_dir))
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
  line = next(x for x in _PRINTED['start'].splitlines() if x.startswith('pretrain: '))
  assert f': {count:,} trainable adapter parameters (LoRA) over a frozen base of ' in line, line


@pytest.mark.slow  # the fixture's LoRA run and two more (~60 s on 2 cores)
def test_lora_checkpoints_hold_adapters_and_resume_exactly(runs, tmp_path):
  base, straight = runs
  step_dir = os.path.join(straight, run_dir_lib.CHECKPOINT_DIR, '4')
  digests = step_meta.read_meta(step_dir)['checksums']
  assert digests and all(lora.is_adapter(k.split('/')[-1]) for k in digests)
  loop.train(_lora(tmp_path, base, **{'train.exit_at_step': 2}))
  loop.train(_lora(tmp_path, base))  # resumes from step 2
  assert [_losses(tmp_path)[s] for s in (3, 4)] == [_losses(straight)[s] for s in (3, 4)]
  # Changed adapters, a base that changed since: one line each.
  with pytest.raises(config_lib.ConfigError, match='train.lora.rank: checkpoint 4, run 8'):
    loop.train(_lora(tmp_path, base, **{'train.lora.rank': 8, 'train.steps': 6}))
  record = os.path.join(tmp_path, lora_checkpoint.BASE_FILE)
  with open(record) as f:
    saved = json.load(f)
  with open(record, 'w') as f:
    json.dump(dict(saved, checksum='0' * 64, fingerprint='0' * 64), f)  # as if rewritten
  with pytest.raises(config_lib.ConfigError, match='the LoRA base changed') as e:
    loop.train(_lora(tmp_path, base, **{'train.steps': 6}))
  assert '\n' not in str(e.value)


def _our_logits(run_dir, tokens):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(str(run_dir))
  config = run_dir_lib.load_run_config(run_dir)
  cfg, adapters, frozen = run_model.restore_lora(run_dir, step_dir, config)
  adapted = np.asarray(model_lib.merge(cfg, lora.combine(adapters, frozen))(tokens))
  base_cfg = model_lib.ModelConfig.from_config(config)
  plain = np.asarray(model_lib.merge(base_cfg, frozen)(tokens))
  return adapted, plain, adapters


def _close(theirs, ours):
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(ours).max())


@pytest.mark.slow  # exports and loads the tiny model in transformers twice (~30 s)
def test_exports_merged_and_peft_give_the_runs_logits(runs, tmp_path):
  from dlmjax.checkpoint import torch_reference  # pylint: disable=import-outside-toplevel

  _, straight = runs
  tokens = np.random.default_rng(0).integers(0, 200, (2, 16)).astype(np.int32)
  ours, plain, adapters = _our_logits(straight, tokens)
  assert np.abs(ours - plain).max() > 100 * 1e-4 * np.abs(ours).max()  # the adapters matter
  merged_dir = str(tmp_path / 'merged')
  assert convert.main(['to-hf', '--checkpoint-path', str(straight), '--output-dir', merged_dir,
                       '--dtype', 'fp32']) == 0  # fmt: skip
  with torch.no_grad():
    merged = torch_reference.transformers_model(merged_dir)
    _close(merged(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy(), ours)
  peft_dir = str(tmp_path / 'peft')
  assert convert.main(['to-hf', '--checkpoint-path', str(straight), '--output-dir', peft_dir,
                       '--dtype', 'fp32', '--adapter', 'peft']) == 0  # fmt: skip
  with open(os.path.join(peft_dir, peft_io.CONFIG_FILE)) as f:
    peft_config = json.load(f)
  assert peft_config['target_modules'] == ['down_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
  assert peft_config['lora_dropout'] == 0.05  # the run's train.lora.dropout, for PEFT to go on
  with torch.no_grad():
    base = torch_reference.transformers_model(os.path.join(peft_dir, 'base'))
    _close(base(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy(), plain)
    model = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    _close(model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy(), ours)
  # And back in: the PEFT directory as init_adapter gives the same adapters.
  config = _lora(tmp_path / 'again', straight, **{'train.lora.init_adapter': peft_dir})
  config.init_from = str(runs[0])
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.devices()[:1]))
  back = peft_io.read_adapter(peft_dir, config, setup)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), jax.device_get(back),
    jax.device_get(adapters),
  )  # fmt: skip
  config.train.lora.rank = 8
  config.train.lora.alpha = 16.0
  with pytest.raises(config_lib.ConfigError, match='set --config.train.lora.rank=4'):
    peft_io.read_adapter(peft_dir, config, state_lib.TrainSetup(config, setup.mesh))
