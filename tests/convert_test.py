"""Conversion end to end: orbax -> HF / torch -> orbax exactly, transformers parity, bad inputs."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import dlmjax
from dlmjax import convert
from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from tests.checkpoint import tiny_run


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """(run dir, config, params) of an untied tiny model with a tokenizer directory."""
  root = tmp_path_factory.mktemp('convert')
  tokenizer = tiny_run.write_tokenizer(root / 'tokenizer', 256)
  config, params, _ = tiny_run.make_run(root / 'run', **{'data.tokenizer': tokenizer})
  return str(root / 'run'), config, params


def _restored(step_dir):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(step_dir)
  config = run_dir_lib.load_run_config(run_dir)
  return config, params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))


def test_hf_round_trip_is_exact(run, tmp_path):
  run_dir, config, params = run
  hf_dir = hf_io.hf_from_checkpoint(
    run_dir, str(tmp_path / 'hf'), dtype='fp32', max_shard_size='100KB'
  )
  files = sorted(os.listdir(hf_dir))
  assert safetensors_io.INDEX_FILE in files
  assert len([f for f in files if f.startswith('model-')]) > 1
  assert {'config.json', 'dlmjax_config.json', 'tokenizer.json'} <= set(files)
  hf = json.loads(open(os.path.join(hf_dir, 'config.json')).read())
  assert (hf['model_type'], hf['mask_token_id'], hf['attn_mask_type']) == (
    'qwen3',
    config.model.mask_token_id,
    'bidirectional',
  )
  step_dir = hf_io.checkpoint_from_hf(hf_dir, str(tmp_path / 'back'))
  back_config, back = _restored(step_dir)
  tiny_run.assert_same_params(params, back)
  assert back_config.model == config.model
  assert step_meta.read_meta(step_dir)['checksums'] == checksums.compute(params)


def test_torch_round_trip_is_exact(run, tmp_path):
  pytest.importorskip('torch')
  run_dir, config, params = run
  out = hf_io.torch_from_checkpoint(run_dir, str(tmp_path / 'model.pt'))
  step_dir = hf_io.checkpoint_from_torch(out, str(tmp_path / 'back'))
  back_config, back = _restored(step_dir)
  tiny_run.assert_same_params(params, back)
  assert back_config.model.to_dict() == config.model.to_dict(), (back_config.model, config.model)


def test_import_without_our_config_derives_it(run, tmp_path):
  run_dir, config, params = run
  hf_dir = hf_io.hf_from_checkpoint(run_dir, str(tmp_path / 'hf'), dtype='bf16')
  os.remove(os.path.join(hf_dir, hf_config.DLMJAX_CONFIG_FILE))
  derived, back = hf_io.load_hf(hf_dir)
  for key in ('num_layers', 'num_kv_heads', 'head_dim', 'ffn_dim', 'vocab_size', 'mask_token_id'):
    assert derived.model[key] == config.model[key]
  assert derived.data.tokenizer == os.path.abspath(hf_dir)
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  rounded = params['blocks']['mlp']['up_proj'].astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(back['blocks']['mlp']['up_proj'], rounded)
  assert safetensors_io.SafetensorsReader(hf_dir).dtype('lm_head.weight') == ml_dtypes.bfloat16


@pytest.mark.parametrize('tie', [False, True])
def test_transformers_qwen3_gives_our_logits(tmp_path, tie):
  pytest.importorskip('transformers')
  from dlmjax.checkpoint import torch_reference  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  config, params, step_dir = tiny_run.make_run(tmp_path / 'run', **{'model.tie_embeddings': tie})
  hf_dir = str(tmp_path / 'hf')
  assert (
    convert.main(
      ['to-hf', '--checkpoint-path', step_dir, '--output-dir', hf_dir, '--dtype', 'fp32']
    )
    == 0
  )
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  ours = np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))
  model = torch_reference.transformers_model(hf_dir)
  with torch.no_grad():
    theirs = model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(ours).max())


def test_config_that_does_not_fit_is_refused(run, tmp_path, capsys):
  run_dir, _, _ = run
  hf_dir = hf_io.hf_from_checkpoint(run_dir, str(tmp_path / 'hf'), dtype='fp32')
  config_file = tmp_path / 'wrong.py'
  config_file.write_text(
    'from tests.checkpoint import tiny_run\n'
    'def get_config():\n'
    '  return tiny_run.tiny_config(**{"model.ffn_dim": 96})\n'
  )
  code = convert.main(
    [
      'from-hf',
      '--hf-dir',
      hf_dir,
      '--output-dir',
      str(tmp_path / 'x'),
      '--config',
      str(config_file),
    ]
  )
  assert code == 2
  assert 'model.ffn_dim: checkpoint 128, config 96' in capsys.readouterr().err


def test_unknown_architecture_and_bad_files_are_refused(run, tmp_path, capsys):
  run_dir, _, _ = run
  hf_dir = hf_io.hf_from_checkpoint(run_dir, str(tmp_path / 'hf'), dtype='fp32')
  hf = json.loads(open(os.path.join(hf_dir, 'config.json')).read())
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(dict(hf, model_type='gpt2', architectures=['GPT2LMHeadModel']), f)
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', str(tmp_path / 'x')]) == 2
  assert 'unknown architecture' in capsys.readouterr().err
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(hf, f)
  shard = os.path.join(hf_dir, 'model.safetensors')
  with open(shard, 'r+b') as f:
    f.truncate(os.path.getsize(shard) - 100)
  with pytest.raises(safetensors_io.SafetensorsError, match='truncated'):
    hf_io.load_hf(hf_dir)


def test_half_written_checkpoint_is_refused(run, tmp_path):
  run_dir, _, _ = run
  copy = tmp_path / 'run'
  shutil.copytree(run_dir, copy)
  shutil.rmtree(copy / 'checkpoints' / '0' / 'params')
  with pytest.raises(run_dir_lib.CheckpointError, match='no complete checkpoint'):
    hf_io.hf_from_checkpoint(str(copy), str(tmp_path / 'hf'))


def test_missing_tensor_in_torch_file_is_named(run, tmp_path):
  torch = pytest.importorskip('torch')
  run_dir, _, _ = run
  out = hf_io.torch_from_checkpoint(run_dir, str(tmp_path / 'model.pt'))
  payload = torch.load(out, weights_only=True)
  del payload['state_dict']['model.layers.0.self_attn.k_norm.weight']
  torch.save(payload, out)
  with pytest.raises(hf_mapping.MappingError, match=r'model\.layers\.0\.self_attn\.k_norm'):
    hf_io.checkpoint_from_torch(out, str(tmp_path / 'back'))


def test_1p7b_structure_exports_one_tensor_at_a_time(tmp_path):
  """The 1.7B preset's structure (28 layers, 16 heads, vocab 50289 padded to 50304, untied) at
  d_model 64 (~33 MB fp32): the export's extra host memory stays near its largest tensor."""
  import tracemalloc  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  config = config_lib.defaults()
  presets.apply_preset(config.model, '1p7b')
  config.model.update(d_model=64, head_dim=4, ffn_dim=192)
  cfg = model_lib.ModelConfig.from_config(config)
  assert (cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.tie_embeddings) == (
    28,
    16,
    50304,
    False,
  )
  rng = np.random.default_rng(0)
  params = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(model_lib.abstract(cfg)[1])[0]:
    node = params
    keys = [k.key for k in path]
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = rng.standard_normal(leaf.shape, dtype=np.float32)
  largest = params['embed_tokens'].nbytes  # 50304 x 64 fp32 = 12.9 MB; lm_head is as large.
  total = sum(a.nbytes for a in jax.tree.leaves(params))
  assert 25e6 < total < 50e6
  tracemalloc.start()
  try:
    hf_io.write_hf(str(tmp_path), config, params, dtype='fp32', max_shard_size='4MB')
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 1.5 * largest, f'peak {peak / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB'

  files = sorted(os.listdir(tmp_path))
  assert not [f for f in files if f.endswith('.partial')]
  shards = [f for f in files if f.endswith('.safetensors')]
  index = json.loads((tmp_path / safetensors_io.INDEX_FILE).read_text())
  entries = hf_mapping.export_entries(cfg, vocab_rows=cfg.vocab_size)
  assert list(index['weight_map']) == [n for n, _ in entries]
  assert sorted(set(index['weight_map'].values())) == shards and len(shards) > 3
  assert shards[0] == f'model-00001-of-{len(shards):05d}.safetensors'
  assert index['metadata']['total_size'] == total
  hf = json.loads((tmp_path / 'config.json').read_text())
  assert (hf['vocab_size'], hf['num_hidden_layers'], hf['tie_word_embeddings']) == (
    50304,
    28,
    False,
  )
  reader = safetensors_io.SafetensorsReader(str(tmp_path))
  np.testing.assert_array_equal(reader.get('model.embed_tokens.weight'), params['embed_tokens'])
  np.testing.assert_array_equal(reader.get('lm_head.weight'), params['lm_head'].T)
  np.testing.assert_array_equal(
    reader.get('model.layers.27.mlp.down_proj.weight'), params['blocks']['mlp']['down_proj'][27].T
  )


def test_tokenizer_larger_than_the_vocab_is_refused(run, tmp_path, capsys):
  run_dir, config, params = run
  # Export: the run's tokenizer has more ids than model.vocab_size.
  wrong = config.copy_and_resolve_references()
  wrong.data.tokenizer = tiny_run.write_tokenizer(tmp_path / 'big', 300)
  with pytest.raises(
    hf_io.ConvertError,
    match=r'has 300 tokens but the run\'s model.vocab_size '
    r'is 256, so ids 256..299 have no embedding row',
  ):
    hf_io.write_hf(str(tmp_path / 'out'), wrong, params)
  assert not (tmp_path / 'out').exists()
  # Import: the Hugging Face directory ships a tokenizer larger than its embedding.
  hf_dir = hf_io.hf_from_checkpoint(run_dir, str(tmp_path / 'hf'), dtype='fp32')
  tiny_run.write_tokenizer(hf_dir, 300)
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', str(tmp_path / 'x')]) == 2
  err = capsys.readouterr().err
  assert 'vocab mismatch' in err and '300 tokens' in err and 'config.json) is 256' in err
  with pytest.raises(hf_io.ConvertError, match='vocab mismatch'):
    dlmjax.load_pretrained(hf_dir)


@pytest.mark.parametrize('command', ['to-hf', 'from-hf', 'from-torch'])
def test_output_dir_that_is_a_file_is_one_line(tmp_path, capsys, command):
  (tmp_path / 'taken').write_text('')
  source = {'to-hf': '--checkpoint-path', 'from-hf': '--hf-dir', 'from-torch': '--input'}[command]
  args = [command, source, str(tmp_path), '--output-dir', str(tmp_path / 'taken')]
  assert convert.main(args) == 2
  assert capsys.readouterr().err == (
    f'error: --output-dir {tmp_path / "taken"} is an existing file, not a directory; '
    'choose another path.\n'
  )
