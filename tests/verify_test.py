"""verify: passes good checkpoints (fp32 and bf16), names what is wrong with bad ones."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from dlmjax import convert
from dlmjax import verify
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import manager
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import safetensors_io
from tests.checkpoint import tiny_run

pytest.importorskip('torch')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('verify')
  config, params, _ = tiny_run.make_run(root / 'run')
  return str(root / 'run'), config, params


def _by_name(checks):
  return {c.name: c for c in checks}


@pytest.mark.parametrize(
  'dtype, backend', [('fp32', 'reference'), ('bf16', 'reference'), ('fp32', 'transformers')]
)
def test_good_checkpoint_passes(run, dtype, backend, capsys, caplog):
  if backend == 'transformers':
    pytest.importorskip('transformers')
  with caplog.at_level(logging.WARNING, logger='absl'):
    code = verify.main(['--checkpoint-path', run[0], '--dtype', dtype, '--backend', backend])
  out = capsys.readouterr().out
  assert code == 0, out
  # orbax's notice that an item directory has no metadata of its own (the step's holds it).
  assert not [r for r in caplog.records if 'Metadata file does not exist' in r.getMessage()]
  assert '8/8 checks passed' in out
  assert f'[{backend} on ' in out and f', {dtype}, 2x32 tokens' in out
  assert '14 digests match' in out


@pytest.mark.parametrize('backend', ['reference', 'transformers'])
@pytest.mark.parametrize('qkv_bias', [False, True])
def test_qwen2_and_llama_family_runs_verify(tmp_path, backend, qkv_bias, capsys):
  """A model without QK-norm (Llama layout), or with q/k/v biases too (Qwen2 layout): both
  PyTorch forwards read its export's names (the random params give the biases non-zero values)."""
  if backend == 'transformers':
    pytest.importorskip('transformers')
  overrides = {'model.qk_norm': False, 'model.qkv_bias': qkv_bias}
  _, params, _ = tiny_run.make_run(tmp_path / 'run', **overrides)
  if qkv_bias:
    assert np.abs(params['blocks']['attn']['q_bias']).min() > 0
  argv = ['--checkpoint-path', str(tmp_path / 'run'), '--dtype', 'fp32', '--backend', backend]
  code = verify.main(argv)
  out = capsys.readouterr().out
  assert code == 0, out
  assert '8/8 checks passed' in out


def test_exported_directory_is_checked_tensor_by_tensor(run, tmp_path):
  run_dir, _, _ = run
  hf_dir = hf_io.hf_from_checkpoint(run_dir, str(tmp_path / 'hf'), dtype='bf16')
  checks = _by_name(verify.verify(run_dir, hf_dir=hf_dir, dtype='fp32', backend='reference'))
  assert all(c.ok for c in checks.values()), checks
  # Change one tensor of the export: the weight check names it.
  reader = safetensors_io.SafetensorsReader(hf_dir)
  tensors = [(k, reader.get(k).copy()) for k in reader.keys()]
  name = 'model.layers.1.mlp.up_proj.weight'
  dict(tensors)[name][0, 0] += 1
  os.remove(os.path.join(hf_dir, 'model.safetensors'))
  safetensors_io.write_model(
    hf_dir, [(k, a.shape, a.dtype) for k, a in tensors], iter(tensors), max_shard_bytes=10**9
  )
  checks = _by_name(verify.verify(run_dir, hf_dir=hf_dir, dtype='fp32', backend='reference'))
  assert not checks['exported weights'].ok
  assert checks['exported weights'].detail.startswith(f'{name}: differs')


def test_non_finite_and_changed_params_are_named(run, tmp_path):
  _, config, params = run
  params = dict(params, final_norm={'scale': params['final_norm']['scale'].copy()})
  params['final_norm']['scale'][3] = np.nan
  step_dir = params_checkpoint.save_params_checkpoint(str(tmp_path / 'nan'), config, params)
  meta_file = os.path.join(step_dir, 'meta', 'metadata')
  meta = json.loads(open(meta_file).read())
  meta['checksums'] = checksums.compute(run[2])  # the digests of the good params
  with open(meta_file, 'w') as f:
    json.dump(meta, f)
  checks = _by_name(verify.verify(step_dir, parity=False))
  assert checks['params finite'].detail == 'non-finite values in final_norm/scale'
  assert checks['checksums'].detail.startswith('final_norm/scale: checksum differs')
  assert verify.main(['--checkpoint-path', step_dir, '--no-parity']) == 1


@pytest.fixture(scope='module')
def train_run(tmp_path_factory):
  """A training checkpoint (params, Adam state with non-zero moments, a data state) at step 3."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import optimizer as optimizer_lib  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp('train_run')
  config = tiny_run.tiny_config(output_dir=str(root))
  params = tiny_run.random_params(config)
  axes = model_lib.abstract(model_lib.ModelConfig.from_config(config))[2]
  opt_state = optimizer_lib.make_optimizer(config.train, axes).init(params)
  rng = np.random.default_rng(0)  # moments that are not all zeros: damage changes values
  opt_state = jax.tree.map(
    lambda x: x + rng.standard_normal(x.shape, np.float32) if x.dtype == np.float32 else x,
    opt_state,
  )
  checkpoints = manager.RunCheckpoints(str(root), async_save=False)
  params_checkpoint.write_run_config(str(root), config)
  state = dict(step=jnp.int32(3), params=params, opt_state=opt_state)
  checkpoints.save(state, data_state={'consumed_samples': 48})
  checkpoints.close()
  return root


def test_train_checkpoint_optimizer_state(train_run):
  checks = _by_name(verify.verify(str(train_run), parity=False))
  assert all(c.ok for c in checks.values()), checks
  assert '2 param-shaped subtrees' in checks['optimizer state'].detail  # Adam's mu and nu
  assert checks['saved state, as resume reads it'].detail.startswith('opt_state, params match')


def _truncate_opt_state(step_dir):
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / 'opt_state') for f in fs]
  target = max(files, key=os.path.getsize)
  os.truncate(target, os.path.getsize(target) // 2)


@pytest.mark.parametrize(
  'damage, name, named',
  [
    (lambda d: tiny_run.flip_bytes(str(d / 'opt_state')), 'saved state', 'opt_state/'),
    (_truncate_opt_state, 'saved state', ''),
    (lambda d: shutil.rmtree(d / 'opt_state'), 'optimizer state', 'not a params-only one'),
    (
      lambda d: tiny_run.edit_meta(str(d), data_state={'consumed_samples': 64}),
      'step metadata',
      'data-iterator state does not match its checksum',
    ),
    (
      lambda d: tiny_run.edit_meta(str(d), drop=['opt_state_checksums']),
      'step metadata',
      'opt_state_checksums missing',
    ),
  ],
  ids=['opt_state_flipped', 'opt_state_truncated', 'opt_state_deleted', 'data_state', 'no_sums'],
)
def test_verify_checks_every_saved_item_as_resume_does(train_run, tmp_path, damage, name, named):
  shutil.copytree(train_run, tmp_path / 'run')
  damage(tmp_path / 'run' / 'checkpoints' / '3')
  checks = verify.verify(str(tmp_path / 'run'), parity=False)
  failed = [c for c in checks if not c.ok]
  assert failed and failed[0].name.startswith(name) and named in failed[0].detail, checks


def test_wrong_shapes_and_missing_items_fail(run, tmp_path):
  run_dir, _, _ = run
  copy = tmp_path / 'run'
  shutil.copytree(run_dir, copy)
  saved = json.loads((copy / 'config.json').read_text())
  saved['model']['ffn_dim'] = 96
  (copy / 'config.json').write_text(json.dumps(saved))
  checks = _by_name(verify.verify(str(copy)))
  assert not checks['params present'].ok
  assert (
    'blocks/mlp/down_proj: saved (2, 128, 64) float32, config implies (2, 96, 64) float32'
    in checks['params present'].detail
  )
  shutil.rmtree(copy / 'checkpoints' / '0' / 'params' / 'd')  # the arrays of a half-written save
  checks = _by_name(verify.verify(str(copy)))
  assert 'half-written or corrupt' in checks['params present'].detail
  checks = verify.verify(str(tmp_path / 'nowhere'))
  assert [(c.name, c.ok) for c in checks] == [('checkpoint found', False)]


@pytest.mark.slow  # ~60 s on 2 cores, half of it compiling the train step.
def test_trained_run_exports_imports_and_verifies_in_all_three_forms(tmp_path, capsys, monkeypatch):
  """The checkpoint round trip end to end: a run trained by dlmjax.train verifies, exports to a
  directory that transformers loads with the same logits, imports back exactly, and each form
  verifies."""
  pytest.importorskip('transformers')
  import runpy  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import dlmjax  # pylint: disable=import-outside-toplevel
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  from tests.conftest import tiny_test_config  # pylint: disable=import-outside-toplevel

  run_dir, hf_dir, back_dir = (str(tmp_path / n) for n in ('run', 'hf', 'back'))
  config = tiny_test_config(
    **{
      'train.steps': 2,
      'train.warmup_steps': 0,
      'train.wsd_decay_steps': 1,
      'model.num_layers': 1,
      'log.every': 1,
      'output_dir': run_dir,
    }
  )
  if os.environ.get('DLMJAX_CACHE_DIR'):
    config.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  loop.train(config)

  script = os.path.join(os.path.dirname(__file__), '..', 'scripts', 'verify_correctness_dlm.py')
  monkeypatch.setattr(sys, 'argv', [script, '--checkpoint-path', run_dir])
  with pytest.raises(SystemExit) as exit_info:
    runpy.run_path(script, run_name='__main__')
  assert exit_info.value.code == 0, capsys.readouterr().out
  assert '[PASS] optimizer state' in capsys.readouterr().out

  assert (
    convert.main(
      [
        'to-hf',
        '--checkpoint-path',
        run_dir,
        '--output-dir',
        hf_dir,
        '--dtype',
        'fp32',
        '--max-shard-size',
        '100KB',
      ]
    )
    == 0
  )
  # The built-in corpus's SentencePiece tokenizer travels with the weights.
  assert os.path.exists(os.path.join(hf_dir, 'tokenizer.model'))
  # --hf-dir: tensor-by-tensor against the run, and transformers' Qwen3 on that directory.
  assert (
    verify.main(['--checkpoint-path', run_dir, '--hf-dir', hf_dir, '--backend', 'transformers'])
    == 0
  ), capsys.readouterr().out
  out = capsys.readouterr().out
  assert '[PASS] exported weights' in out and '[transformers on ' in out

  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', back_dir]) == 0
  assert verify.main(['--checkpoint-path', back_dir]) == 0, capsys.readouterr().out
  trained = dlmjax.load_pretrained(run_dir)
  tiny_run.assert_same_params(trained.params, dlmjax.load_pretrained(back_dir).params)
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 16))
  np.testing.assert_array_equal(
    dlmjax.load_pretrained(hf_dir).logits(tokens), trained.logits(tokens)
  )


def _family_dir(directory, family):
  from tests.checkpoint import family_dirs  # pylint: disable=import-outside-toplevel

  if family == 'llada':
    return family_dirs.llada_dir(directory, 'gqa_tied_qkv_bias_padded')[0]
  if family == 'sdar':
    return family_dirs.sdar_dir(directory)
  return family_dirs.transformers_dir(directory, family)


@pytest.mark.parametrize('family', ['llada', 'qwen2', 'llama', 'sdar'])
def test_verify_hf_dir_checks_an_import_against_its_source_directory(tmp_path, family, capsys):
  """verify --hf-dir on the directory a run was imported from: its tensors (read through the
  family's own names) equal the checkpoint's, and the PyTorch forward gives our logits (on the
  directory itself where transformers has the class, else on an export of the same weights)."""
  pytest.importorskip('transformers')
  hf_dir = _family_dir(tmp_path / 'hf', family)
  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  capsys.readouterr()
  assert verify.main(['--checkpoint-path', run_dir, '--hf-dir', hf_dir]) == 0, capsys.readouterr()
  out = capsys.readouterr().out
  weights = 'source weights' if family == 'llada' else 'exported weights'
  assert f'[PASS] {weights}' in out and '[PASS] logits parity' in out
  if family != 'llada':
    return
  # One changed tensor in LLaDA's second shard: the weight check names the array it lands in.
  safetensors_torch = pytest.importorskip('safetensors.torch')
  shard = os.path.join(hf_dir, 'model-00002-of-00002.safetensors')
  tensors = safetensors_torch.load_file(shard)
  name = 'model.transformer.blocks.1.up_proj.weight'
  tensors[name][0, 0] += 1
  safetensors_torch.save_file(tensors, shard, metadata={'format': 'pt'})
  checks = _by_name(verify.verify(run_dir, hf_dir=hf_dir))
  assert not checks['source weights'].ok
  assert checks['source weights'].detail.startswith('blocks/mlp/up_proj: differs')
