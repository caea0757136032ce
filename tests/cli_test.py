"""The command lines' shared plumbing (dlmjax/cli.py): a config error, key or value, is one line,
refused before jax, flax, optax, orbax or grain are imported (seconds saved on every typo); every
user error is one `error:` line."""

import json
import os
import subprocess
import sys

import pytest

from dlmjax import cli
from dlmjax import config as config_lib
from dlmjax.checkpoint import manager
from dlmjax.data import errors as data_errors
from dlmjax.train import guards, loop

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
HEAVY = ('jax', 'flax', 'orbax', 'grain', 'optax')

# Runs `python -m MODULE ARGS` in-process for each command line (each ends at its error) and
# reports the exit codes, the error lines and which heavy packages were imported by then.
_PROBE = """
import contextlib, io, json, runpy, sys
results = []
for module, *args in json.loads(sys.argv[1]):
  sys.argv = [module, *args]
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      runpy.run_module(module, run_name='__main__', alter_sys=True)
    code = 0
  except SystemExit as e:
    code = e.code
  results.append([code, err.getvalue().strip()])
print(json.dumps({'results': results, 'heavy': [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def test_a_bad_command_line_is_refused_before_the_heavy_imports():
  cases = [  # (command line, what its one error line says)
    (['dlmjax.train', '--config.train.nope=1'], 'train.nope is not a config key'),
    (['dlmjax.train', '--config.train.lr=fast'], "train.lr='fast'"),
    (['dlmjax.train', '--config.model.preset=tiny9'], "model.preset='tiny9' is not a preset"),
    (['dlmjax.train', '--config=configs/nope.py'], 'configs/nope.py: it does not exist'),
    (
      ['dlmjax.train', '--config=configs/rl.py', '--config.rl.gen_length=9'],
      'rl.gen_length is now sampler.gen_length',
    ),
    (['dlmjax.summary', '--config.model.seq_len=long'], "model.seq_len='long'"),
    # Values, one per check group and registry: refused by config.validate_early, still before jax.
    (['dlmjax.train', '--config.train.lr=-1'], 'train.lr=-1.0 must be > 0'),
    (['dlmjax.summary', '--config.train.lr=-1'], 'train.lr=-1.0 must be > 0'),
    (['dlmjax.train', '--config.model.attention_backend=nope'], "model.attention_backend='nope'"),
    (['dlmjax.train', '--config.model.num_kv_heads=3'], 'not a multiple of model.num_kv_heads=3'),
    (['dlmjax.train', '--config.sampler.cache=nope'], "sampler.cache='nope' is not one of"),
    (['dlmjax.train', '--config.diffusion.objective=nope'], "diffusion.objective='nope'"),
    (['dlmjax.train', '--config.log.outputs=nope'], "names 'nope'"),
    (['dlmjax.train', '--config.data.source=nope'], "data.source='nope'"),
    (['dlmjax.train', '--config.mesh.data=3'], 'mesh.data x mesh.fsdp x mesh.expert = 3'),
    (
      ['dlmjax.train', '--config.stage=preference', '--config.preference.n_time=3'],
      'preference.budget=8 is not a multiple of preference.n_time=3',
    ),
    # With init_from the choices are checked at once (the rest after its model keys are adopted).
    (
      ['dlmjax.train', '--config=configs/rl.py', '--config.rl.objective=nope'],
      "rl.objective='nope'",
    ),
    (
      ['dlmjax.train', '--config=configs/sft.py', '--config.sft.objective=nope'],
      "sft.objective='no",
    ),
  ]
  out = subprocess.run(
    [sys.executable, '-c', _PROBE, json.dumps([command for command, _ in cases])],
    cwd=REPO,
    env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu'),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(report['results']) == len(cases)
  for (_, expected), (code, error) in zip(cases, report['results']):
    assert code == 2 and error.startswith('error: ') and expected in error, (expected, error)
    assert len(error.splitlines()) == 1, error
  assert report['heavy'] == [], f'imported before the config was checked: {report["heavy"]}'


@pytest.mark.parametrize(
  'argv',
  [
    ['--config=configs/sft.py'],  # init_from: its model keys are adopted later, not refused here
    ['--config.model.preset=tiny_moe', '--config.train.steps=3', '--verbosity=1'],
    ['--config.train.steps=5'],  # shorter than warmup + anneal: the run fits the schedule to it
    # 100 + sampler.gen_length 64 exceed the default model.seq_len 128, not init_from's own, which
    # the run adopts before it checks the values.
    ['--config=configs/rl.py', '--config.rl.max_prompt_tokens=100'],
  ],
)
def test_a_good_command_line_passes_the_early_check(argv, monkeypatch):
  monkeypatch.chdir(REPO)
  monkeypatch.setattr(sys, 'argv', ['dlmjax.train', *argv])
  cli.check_command_line('configs/tiny.py')  # returns; a refusal would exit


def test_every_error_the_command_lines_report_is_a_user_error():
  for error in (
    config_lib.ConfigError,
    manager.CheckpointError,
    data_errors.DataError,
    loop.NonFiniteError,
    guards.ResourceError,
  ):
    assert issubclass(error, cli.user_errors()), error
  assert not issubclass(KeyError, cli.user_errors())  # a bug keeps its traceback
