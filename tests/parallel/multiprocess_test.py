"""Several local JAX processes with 2 CPU devices each, launched by scripts/dlm_pretrain_1p7b.sh
exactly as on a cluster (envs/.env variables, one process per "GPU", two "nodes" for 4 processes).

One run per process count: 2 processes train steps 1-2 and checkpoint; 4 processes resume that
checkpoint (a different mesh and process count) and train steps 3-4. Every loss matches one
process (8 devices); each process reads only its rows; one process writes.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from dlmjax.train import loop
from tests.conftest import FAST_COMPILE, tiny_test_config
from tests.parallel import processes

pytestmark = pytest.mark.multiprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
# tiny_test_config with 4 steps, as command-line overrides (the reference applies the same).
OVERRIDES = {
  'model.num_layers': 2,
  'model.d_model': 64,
  'model.num_heads': 4,
  'model.num_kv_heads': 2,
  'model.head_dim': 16,
  'model.ffn_dim': 128,
  'model.seq_len': 32,
  'train.global_batch_size': 16,
  'train.micro_batch_size': 8,
  'train.steps': 4,
  'train.warmup_steps': 1,
  'train.wsd_decay_steps': 1,
  'log.every': 1,
  'checkpoint.every': 0,
}


def _launch(tmp, run_dir, *, nodes, exit_at_step=0, script=None):
  """Runs the pretrain script (or `script`: [path, args...]) once per node (all at once);
  returns their combined output."""
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in processes.LAUNCH_VARS and not k.startswith('SLURM_')
  }
  env.update(
    PYTHON=sys.executable,
    DLMJAX_ENV_FILE=str(tmp / 'env'),
    CKPT_DIR=str(tmp),
    OUTPUT_DIR=str(run_dir),
    CONFIG='configs/tiny.py',
    NUM_NODES=str(nodes),
    MASTER_ADDR='localhost',
    GPUS_PER_NODE='2',
    PROCESSES_PER_NODE='2',
    JAX_PLATFORMS='cpu',
    JAX_NUM_CPU_DEVICES='2',
    # A fraction of the compile time; all processes compile alike.
    XLA_FLAGS=' '.join(FAST_COMPILE),
  )
  if script is None:
    args = [f'--config.{k}={v}' for k, v in OVERRIDES.items()]
    args += [
      f'--config.data.cache_dir={processes.cache_dir(tmp)}',
      f'--config.train.exit_at_step={exit_at_step}',
    ]
    script = ['scripts/dlm_pretrain_1p7b.sh', *args]
  with processes.reserved_port() as port:
    nodes = [
      subprocess.Popen(
        ['bash', *script],
        cwd=ROOT,
        env=dict(env, NODE_RANK=str(rank), MASTER_PORT=str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
      for rank in range(nodes)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
  for node, output in zip(nodes, outputs):
    assert node.returncode == 0, output[-3000:]
  return '\n'.join(outputs)


def _rows(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _reference(tmp):
  """One process on 8 devices, steps 1-4 straight: the layouts differ from the 4 devices of
  steps 1-2 only in the reduction order (within the tolerance), and one compile is saved."""
  config = tiny_test_config(**OVERRIDES)
  config.output_dir, config.data.cache_dir = str(tmp / 'reference'), processes.cache_dir(tmp)
  loop.train(config)
  return _rows(config.output_dir)


def test_two_then_four_processes_match_one_process(tmp_path):
  run_dir = tmp_path / 'run'
  two = _launch(tmp_path, run_dir, nodes=1, exit_at_step=2)  # 2 processes x 2 devices
  rows_two = _rows(run_dir)
  assert [r['step'] for r in rows_two] == [1, 2]  # one writer: no duplicated rows
  assert two.count('step 2/4') == 1 and two.count('compiled and ran the first step') == 1
  assert 'data 1 x fsdp 4' in two
  # The checksums saved from 2 processes (of arrays no process holds whole) are the params'.
  step_dir = os.path.join(run_dir, 'checkpoints', '2')
  saved = run_dir_lib.load_run_config(str(run_dir))
  params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(saved))
  assert step_meta.read_meta(step_dir)['checksums'] == checksums.compute(params)

  four = _launch(tmp_path, run_dir, nodes=2)  # 2 "nodes" x 2 processes x 2 devices, resumed
  rows = _rows(run_dir)
  assert [r['step'] for r in rows] == [1, 2, 3, 4]
  assert four.count('resuming from') == 1 and four.count('step 4/4') == 1
  assert 'data 1 x fsdp 8' in four

  reference = _reference(tmp_path)
  assert [r['step'] for r in reference] == [1, 2, 3, 4]
  for key in ('loss', 'masked_ce', 'grad_norm'):
    np.testing.assert_allclose(
      [r[key] for r in rows], [r[key] for r in reference], rtol=1e-5, err_msg=key
    )
  assert rows[3]['loss'] < rows[0]['loss']


# Stage rl from a random tiny model: 2 rollouts of 4 prompts x G=4, d1 with a frozen reference
# kept in host memory between rollouts.
RL_OVERRIDES = {
  'train.global_batch_size': 16,
  'train.micro_batch_size': 8,
  'train.steps': 4,
  'train.warmup_steps': 0,
  'rl.num_prompts': 16,
  'rl.task': 'countdown3',  # its prompts fit 32 tokens (configs/rl.py's sudoku4 needs 48)
  'rl.max_prompt_tokens': 32,
  'sampler.gen_length': 16,
  'sampler.steps': 2,
  'sampler.block_length': 16,
  'rl.group_size': 4,
  'rl.inner_updates': 2,
  'log.every': 1,
  'rl.reference_on_host': True,
  'checkpoint.every': 0,
  'log.outputs': '',
}


def test_rl_on_two_processes_matches_one_process(tmp_path, monkeypatch):
  """Each process generates and scores the same whole rollout on the global mesh and feeds its
  rows; losses, KL and rewards equal one process on the same 4 devices."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  init = str(tmp_path / 'init')
  source = tiny_test_config(**{'model.seq_len': 64, 'output_dir': init})
  source.data.cache_dir = processes.cache_dir(tmp_path)
  params = model_lib.init_params(model_lib.ModelConfig.from_config(source), jax.random.key(0))
  params_checkpoint.save_params_checkpoint(init, source, jax.device_get(params))
  overrides = dict(
    RL_OVERRIDES, init_from=init, **{'data.cache_dir': processes.cache_dir(tmp_path)}
  )
  run_dir = tmp_path / 'rl'
  args = [f'--config.{k}={v}' for k, v in overrides.items()]
  out = _launch(tmp_path, run_dir, nodes=1, script=['scripts/dlm_rl.sh', 'configs/rl.py', *args])
  assert 'data 1 x fsdp 4' in out and out.count('step 4/4') == 1
  rows = _rows(run_dir)

  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'rl.py'))
  config_lib.apply_overrides(config, dict(overrides, output_dir=str(tmp_path / 'reference')))
  all_devices = jax.devices()
  with monkeypatch.context() as patch:
    patch.setattr(jax, 'devices', lambda *args: all_devices[:4])
    loop.train(config)
  reference = _rows(config.output_dir)
  for name in ('loss', 'kl', 'grad_norm', 'reward_mean'):
    ours, theirs = ([r[name] for r in rs if name in r] for rs in (rows, reference))
    assert len(ours) == 4, name
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7, err_msg=name)
  rollouts = [[r['rollout_reward_mean'] for r in rs if 'rollout' in r] for rs in (rows, reference)]
  assert len(rollouts[0]) == 2 and rollouts[0] == rollouts[1]
