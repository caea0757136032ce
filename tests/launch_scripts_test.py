"""The shell wrappers chain: pre-training writes what SFT reads, SFT writes what RL reads, and the
command line's overrides reach python last (so they win). A fake interpreter prints its
arguments instead of training."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_args(tmp_path, script, *args, **env):
  fake = tmp_path / 'python'
  fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
  fake.chmod(0o755)
  (tmp_path / 'env').write_text(f'CKPT_DIR={tmp_path}/runs\nPROCESSES_PER_NODE=1\n')
  out = subprocess.run(
    ['bash', os.path.join('scripts', script), *args],
    cwd=ROOT,
    env={**os.environ, 'PYTHON': str(fake), 'DLMJAX_ENV_FILE': str(tmp_path / 'env'), **env},
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split('\n')
  values = {}
  for arg in out:  # the last --config.KEY=VALUE wins, as in dlmjax.config.parse_command_line
    if arg.startswith('--config.') and '=' in arg:
      key, value = arg[len('--config.') :].split('=', 1)
      values[key] = value
  return out, values


def test_stages_chain_their_run_directories(tmp_path):
  _, pretrain = _python_args(tmp_path, 'dlm_pretrain_1p7b.sh', TRAIN_PREFIXES='/d/c')
  _, sft = _python_args(tmp_path, 'dlm_sft.sh', 'configs/sft.py')
  _, rl = _python_args(tmp_path, 'dlm_rl.sh', 'configs/rl.py')
  assert pretrain['output_dir'] == sft['init_from'] == f'{tmp_path}/runs/dlm_pretrain_1p7b'
  assert sft['output_dir'] == rl['init_from'] == f'{tmp_path}/runs/dlm_sft'
  assert rl['output_dir'] == f'{tmp_path}/runs/dlm_rl'
  assert pretrain['data.train_prefixes'] == '/d/c'


def test_overrides_pass_through_and_win(tmp_path):
  out, rl = _python_args(
    tmp_path, 'dlm_rl.sh', 'configs/rl.py', '--config.init_from=x', '--config.train.steps=3'
  )
  assert rl['init_from'] == 'x' and rl['train.steps'] == '3'
  assert out[:3] == ['-m', 'dlmjax.train', '--config=configs/rl.py']
