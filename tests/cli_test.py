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
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import run_dir as run_dir_lib
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


def _sources(directory, seq_len: int) -> tuple[str, str]:
  """(run dir, Hugging Face dir) of a model whose model.seq_len is seq_len: only the files the
  config readers open (config.json, a committed step's params/ and an empty model.safetensors)."""
  source = config_lib.defaults()
  source.model.seq_len = seq_len
  run, hf = directory / f'run{seq_len}', directory / f'hf{seq_len}'
  (run / 'checkpoints' / '3' / 'params').mkdir(parents=True)
  (run / 'config.json').write_text(source.to_json())
  hf.mkdir()
  rows = source.model.vocab_size
  (hf / 'config.json').write_text(
    json.dumps(hf_config.to_hf(source, vocab_rows=rows, dtype='fp32'))
  )
  (hf / 'model.safetensors').touch()
  return str(run), str(hf)


def test_a_bad_command_line_is_refused_before_the_heavy_imports(tmp_path):
  run, hf = _sources(tmp_path, seq_len=128)
  sft = ['dlmjax.train', '--config=configs/sft.py']
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
    # With init_from the choices are checked first, the rest after the source's model keys are
    # adopted (read from a run or a Hugging Face directory without jax).
    (sft + [f'--config.init_from={run}', '--config.train.lr=-1'], 'train.lr=-1.0 must be > 0'),
    (sft + [f'--config.init_from={hf}', '--config.train.lr=-1'], 'train.lr=-1.0 must be > 0'),
    (sft + [f'--config.init_from={tmp_path}/none'], "/none' does not exist: train the model"),
    (  # valid with a longer source (test_a_good_command_line_passes_the_early_check)
      ['dlmjax.train', '--config=configs/rl.py', f'--config.init_from={hf}']
      + ['--config.rl.max_prompt_tokens=100'],
      'rl.max_prompt_tokens + sampler.gen_length = 132 exceed model.seq_len=128',
    ),
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
    ['--config=configs/sft.py', '--config.init_from={run}'],
    ['--config=configs/sft.py', '--config.init_from={hf}'],
    ['--config.model.preset=tiny_moe', '--config.train.steps=3', '--verbosity=1'],
    ['--config.train.steps=5'],  # shorter than warmup + anneal: the run fits the schedule to it
    # 100 + sampler.gen_length 32 (configs/rl.py) exceed the default model.seq_len 128, not the
    # source's 256, which the early check adopts (as the run does) before it checks the values.
    ['--config=configs/rl.py', '--config.init_from={run}', '--config.rl.max_prompt_tokens=100'],
    ['--config=configs/rl.py', '--config.init_from={hf}', '--config.rl.max_prompt_tokens=100'],
  ],
)
def test_a_good_command_line_passes_the_early_check(argv, monkeypatch, tmp_path):
  run, hf = _sources(tmp_path, seq_len=256)
  monkeypatch.chdir(REPO)
  monkeypatch.setattr(sys, 'argv', ['dlmjax.train', *(a.format(run=run, hf=hf) for a in argv)])
  cli.check_command_line('configs/tiny.py')  # returns; a refusal would exit


def test_summary_checks_a_config_whose_source_is_not_trained_yet(monkeypatch, tmp_path):
  """summary describes such a config with its own model keys (summary.py), so it checks those."""
  monkeypatch.chdir(REPO)
  argv = ['--config=configs/sft.py', f'--config.init_from={tmp_path}/none']
  monkeypatch.setattr(sys, 'argv', ['dlmjax.summary', *argv])
  cli.check_command_line('configs/tiny.py', source_required=False)
  monkeypatch.setattr(sys, 'argv', ['dlmjax.summary', *argv, '--config.train.lr=-1'])
  with pytest.raises(SystemExit):
    cli.check_command_line('configs/tiny.py', source_required=False)


def test_every_error_the_command_lines_report_is_a_user_error():
  for error in (
    config_lib.ConfigError,
    run_dir_lib.CheckpointError,
    data_errors.DataError,
    loop.NonFiniteError,
    guards.ResourceError,
  ):
    assert issubclass(error, cli.user_errors()), error
  assert not issubclass(KeyError, cli.user_errors())  # a bug keeps its traceback
