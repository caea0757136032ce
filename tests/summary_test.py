"""The summary CLI (and the shared CLI error handling): counts, and one-line errors with exit 2."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), '..')


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='')
  return subprocess.run(
    [sys.executable, '-m', 'dlmjax.summary', *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_pretrain_1p7b_counts():
  result = _run(
    '--config=configs/pretrain_1p7b.py',
    '--devices=8',
    '--config.mesh.fsdp=8',
    '--config.train.micro_batch_size=32',
  )
  assert result.returncode == 0, result.stderr
  assert '1,732,895,744' in result.stdout and '1,732,834,304' in result.stdout
  assert 'FLOPs per token (train): 1.1189e+10' in result.stdout


@pytest.mark.parametrize(
  'args,message',
  [
    (['--config.model.d_modle=3'], 'Did you mean "d_model"'),
    (['--config.model.d_model=abc'], 'invalid literal'),
    (['--config.mesh.tensor=3'], 'not divisible by mesh.tensor=3'),
    (['--config=configs/missing.py'], 'cannot load the --config file'),
    (['--config.rl.gen_length=64'], 'rl.gen_length is now sampler.gen_length.'),
  ],
)
def test_bad_input_is_one_line(args, message):
  result = _run(*(args if args[0].startswith('--config=') else ['--config=configs/tiny.py', *args]))
  assert result.returncode == 2
  assert message in result.stderr
  assert 'Traceback' not in result.stderr
