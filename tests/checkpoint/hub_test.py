"""Hub ids (`org/name[@revision]`) resolve through huggingface_hub's cache for every entry point:
init_from, convert from-hf, load_pretrained (and so generate, evaluate, serve). The cache is laid
out here the way snapshot_download lays it out, and the tests run offline."""

import os
import shutil

import numpy as np
import pytest

import dlmjax
from dlmjax import convert
from dlmjax import generate
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import init_from
from dlmjax.checkpoint import run_dir as run_dir_lib
from tests.checkpoint import tiny_run

COMMIT = '0123456789abcdef0123456789abcdef01234567'


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  """(cache dir, logits of the run it holds, tokens): one export as models--org--tiny."""
  root = tmp_path_factory.mktemp('hub')
  config, params, _ = tiny_run.make_run(root / 'run', **{'model.vocab_size': 250})
  export = hf_io.hf_from_checkpoint(
    str(root / 'run'), str(root / 'hf'), dtype='fp32', trim_vocab=True
  )
  repo = root / 'cache' / 'models--org--tiny'
  shutil.copytree(export, repo / 'snapshots' / COMMIT)
  (repo / 'refs').mkdir()
  (repo / 'refs' / 'main').write_text(COMMIT)
  tokens = np.random.default_rng(0).integers(0, 250, (1, 8))
  expected = np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))
  return str(root / 'cache'), expected[..., :250], tokens


@pytest.fixture(autouse=True)
def offline_cache(cache, monkeypatch):
  monkeypatch.setenv('HF_HUB_CACHE', cache[0])
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')


def test_ids_resolve_to_the_cached_snapshot(cache):
  snapshot = os.path.join(cache[0], 'models--org--tiny', 'snapshots', COMMIT)
  assert hub.resolve('org/tiny') == snapshot  # refs/main names the commit
  assert hub.resolve(f'org/tiny@{COMMIT}') == snapshot
  assert hub.resolve('org/tiny@main') == snapshot
  assert hub.resolve('/no/such/dir') == '/no/such/dir'  # local paths pass through unchanged


def test_every_entry_point_reads_a_hub_id(cache, tmp_path):
  _, expected, tokens = cache
  model = dlmjax.load_pretrained('org/tiny')  # generate, evaluate and the server load this way
  np.testing.assert_allclose(model.logits(tokens), expected, atol=1e-4)
  assert init_from.source_config('org/tiny').model.vocab_size == 250
  out = tmp_path / 'imported'
  assert convert.main(['from-hf', '--hf-dir', 'org/tiny', '--output-dir', str(out)]) == 0
  assert run_dir_lib.resolve_step_dir(str(out))[2] == 0


def test_an_id_missing_offline_is_one_line_naming_it_and_the_cache(cache, capsys):
  with pytest.raises(hub.HubError) as raised:
    hub.resolve('org/absent@v2')
  message = str(raised.value)
  assert "'org/absent@v2'" in message and cache[0] in message and 'HF_HUB_OFFLINE' in message
  argv = ['--checkpoint-path', 'org/absent', '--prompt', 'x', '--gen-length', '8']
  assert generate.main(argv + ['--steps', '8', '--block-length', '8']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error:') and 'org/absent' in err[0]
