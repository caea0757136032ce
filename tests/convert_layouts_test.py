"""Export layouts (convert to-hf --layout): each writes its family's names and config.json and
re-imports bit-exact; LLaDA's is what LLaDA's forward computes; `source` goes back to the family
an import came from; a layout that cannot hold the model is refused in one line naming one that
can. And the export runs correctly in plain transformers: AutoModelForCausalLM gives our logits
for every mask kind (bidirectional with no flag at all)."""

import json
import os

import numpy as np
import pytest

from dlmjax import convert
from dlmjax import model as model_lib
from dlmjax import verify
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from tests.checkpoint import family_dirs, references, tiny_run

torch = pytest.importorskip('torch')

# layout -> the model options it holds (tiny_run's model: 4 heads x 16 = d_model 64).
LAYOUTS = {
  'qwen3': {'model.qk_norm': True, 'model.qkv_bias': False},
  'qwen2': {'model.qk_norm': False, 'model.qkv_bias': True},
  'llama': {'model.qk_norm': False, 'model.qkv_bias': False},
  'llada': {'model.qk_norm': False, 'model.qkv_bias': True, 'model.tie_embeddings': True},
}
# Which of these names each layout writes.
_Q_NORM, _K_BIAS = 'model.layers.0.self_attn.q_norm.weight', 'model.layers.0.self_attn.k_proj.bias'
_GATE, _FF_PROJ = 'model.layers.0.mlp.gate_proj.weight', 'model.transformer.blocks.0.ff_proj.weight'
_WRITES = {
  'qwen3': {_Q_NORM, _GATE},
  'qwen2': {_K_BIAS, _GATE},
  'llama': {_GATE},
  'llada': {_FF_PROJ},
}


def _to_hf(run_dir, out, *extra):
  argv = ['to-hf', '--checkpoint-path', run_dir, '--output-dir', out, '--dtype', 'fp32', *extra]
  return convert.main(argv)


def _restored(step_dir):
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(step_dir)
  config = run_dir_lib.load_run_config(run_dir)
  return config, params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))


def _ours(config, params, tokens):
  return np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_each_layout_reimports_bit_exact(tmp_path, layout):
  config, params, _ = tiny_run.make_run(tmp_path / 'run', **LAYOUTS[layout])
  out = str(tmp_path / 'hf')
  assert _to_hf(str(tmp_path / 'run'), out, '--layout', layout) == 0
  names = set(safetensors_io.SafetensorsReader(out).keys())
  assert names & {_Q_NORM, _K_BIAS, _GATE, _FF_PROJ} == _WRITES[layout]
  step_dir = hf_io.checkpoint_from_hf(out, str(tmp_path / 'back'))
  assert step_meta.read_meta(step_dir)['source']['family'] == layout
  back_config, back = _restored(step_dir)
  tiny_run.assert_same_params(params, back)
  assert back_config.model == config.model
  # Without our dlmjax_config.json the layout's own config.json alone says the same model.
  os.remove(os.path.join(out, 'dlmjax_config.json'))
  derived, back = hf_io.load_hf(out)
  tiny_run.assert_same_params(params, back)
  for key in ('num_kv_heads', 'head_dim', 'ffn_dim', 'qk_norm', 'qkv_bias', 'tie_embeddings'):
    assert derived.model[key] == config.model[key], key


@pytest.mark.parametrize('tie', [False, True])
def test_llada_export_is_the_llada_forward(tmp_path, capsys, tie):
  """LLaDA's names and config.json: the float64 forward written from LLaDA's formulas
  (references.llada_reference) on the exported files gives our logits."""
  overrides = dict(LAYOUTS['llada'], **{'model.tie_embeddings': tie, 'model.rope_theta': 5e5})
  config, params, _ = tiny_run.make_run(tmp_path / 'run', **overrides)
  out = str(tmp_path / 'hf')
  assert _to_hf(str(tmp_path / 'run'), out, '--layout', 'llada') == 0
  with open(os.path.join(out, 'config.json')) as f:
    hf = json.load(f)
  assert (hf['model_type'], hf['architectures'], hf['block_type']) == (
    'llada',
    ['LLaDAModelLM'],
    'llama',
  )
  m = config.model
  assert (hf['d_model'], hf['n_heads'], hf['n_kv_heads'], hf['mlp_hidden_size']) == (
    m.d_model,
    m.num_heads,
    m.num_kv_heads,
    m.ffn_dim,
  )
  assert (hf['mask_token_id'], hf['weight_tying'], hf['include_qkv_bias']) == (
    m.mask_token_id,
    tie,
    True,
  )
  assert hf['auto_map']['AutoModel'].endswith('--modeling_llada.LLaDAModelLM')
  reader = safetensors_io.SafetensorsReader(out)
  sd = {k: torch.from_numpy(reader.get(k)) for k in reader.keys()}
  assert ('model.transformer.ff_out.weight' in sd) is not tie
  tokens = np.random.default_rng(1).integers(0, m.vocab_size, (2, 24))
  theirs = references.llada_reference(sd, hf, tokens)
  ours = _ours(config, params, tokens)
  references.assert_close(theirs[..., : ours.shape[-1]], ours)
  with pytest.raises(AssertionError):  # the comparison sees a wrong detail
    wrong = references.llada_reference(sd, hf, tokens, swap_gate_up=True)
    references.assert_close(wrong[..., : ours.shape[-1]], ours)
  if not tie:  # verify reads the LLaDA layout through LLaDA's names; parity on a Llama export
    capsys.readouterr()
    assert verify.main(['--checkpoint-path', str(tmp_path / 'run'), '--hf-dir', out]) == 0
    assert '[PASS] source weights' in capsys.readouterr().out


def test_source_layout_goes_back_to_the_imported_family(tmp_path):
  """A LLaDA import exports as LLaDA by default, and so does a run started from it
  (init_from); --layout overrides."""
  hf_dir, _, _ = family_dirs.llada_dir(tmp_path / 'llada', 'gqa_tied_qkv_bias_padded')
  imported = str(tmp_path / 'imported')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', imported]) == 0
  config, params = _restored(imported)
  finetuned = tmp_path / 'finetuned'
  config.init_from, config.output_dir = imported, str(finetuned)
  # a run's save, no `source`
  params_checkpoint.save_params_checkpoint(str(finetuned), config, params)
  assert 'source' not in step_meta.read_meta(run_dir_lib.resolve_step_dir(str(finetuned))[1])
  for run in (imported, str(finetuned)):
    assert hf_io.source_family(run) == 'llada'
    out = str(tmp_path / f'out_{os.path.basename(run)}')
    assert _to_hf(run, out) == 0
    assert 'model.transformer.blocks.0.ff_proj.weight' in safetensors_io.SafetensorsReader(out)
  assert _to_hf(imported, str(tmp_path / 'as_qwen2'), '--layout', 'qwen2') == 0
  with open(tmp_path / 'as_qwen2' / 'config.json') as f:
    assert json.load(f)['model_type'] == 'qwen2'
  # A run that was never imported exports by its options (here Qwen3: QK-norm).
  tiny_run.make_run(tmp_path / 'scratch')
  assert hf_io.source_family(str(tmp_path / 'scratch')) is None
  assert _to_hf(str(tmp_path / 'scratch'), str(tmp_path / 'scratch_hf')) == 0
  with open(tmp_path / 'scratch_hf' / 'config.json') as f:
    assert json.load(f)['model_type'] == 'qwen3'


@pytest.mark.parametrize(
  'layout, overrides, named',
  [
    ('qwen3', LAYOUTS['llama'], 'has QK-norm weights; use --layout=llama'),
    ('llama', LAYOUTS['qwen2'], 'has no q/k/v biases; use --layout=qwen2'),
    ('qwen2', LAYOUTS['qwen3'], 'has no QK-norm and has q/k/v biases; use --layout=qwen3'),
    ('llada', LAYOUTS['qwen3'], 'the llada layout has no QK-norm; use --layout=qwen3'),
    ('llada', dict(LAYOUTS['llama'], **{'model.head_dim': 8}), 'use --layout=llama'),
    ('llada', dict(LAYOUTS['llama'], **{'model.attention_mask': 'causal'}), 'is causal'),
  ],
)
def test_a_layout_that_cannot_hold_the_model_is_refused_in_one_line(
  tmp_path, capsys, layout, overrides, named
):
  tiny_run.make_run(tmp_path / 'run', **overrides)
  out = tmp_path / 'hf'
  assert _to_hf(str(tmp_path / 'run'), str(out), '--layout', layout) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f'error: cannot export with --layout={layout}: ') and named in err, err
  assert len(err.splitlines()) == 1 and not out.exists()


def test_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
  tiny_run.make_run(tmp_path / 'run')
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  assert _to_hf(str(tmp_path / 'run'), str(a_file)) == 2
  assert _to_hf(str(tmp_path / 'run'), str(tmp_path / 'hf')) == 0
  argv = ['from-hf', '--hf-dir', str(tmp_path / 'hf'), '--output-dir', str(a_file)]
  assert convert.main(argv) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert (
    lines
    == [f'error: --output-dir {a_file} is an existing file, not a directory; choose another path.']
    * 2
  )


# ----------------------------------------------------------------------------------------------
# Plain transformers on the export, loaded as the README says


def _transformers(hf_dir, **kwargs):
  transformers = pytest.importorskip('transformers')
  transformers.utils.logging.disable_progress_bar()
  return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kwargs)


def _theirs(model, tokens):
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens)).logits.numpy()


def _rel(theirs, ours):
  return float(np.abs(theirs - ours).max() / np.abs(ours).max())


@pytest.mark.parametrize(
  'layout, kind',
  [('qwen3', k) for k in ('bidirectional', 'causal', 'block_causal')]
  + [('qwen2', 'bidirectional'), ('llama', 'block_causal')],
)
def test_autoclass_on_the_export_gives_our_logits(tmp_path, layout, kind):
  """AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True) loads our shipped
  modeling_dlmjax.py and computes the trained mask kind: <= 1e-4 relative to our logits; a
  bidirectional or causal export needs no flag at all (config.json's is_causal). The other
  kinds' logits are far from ours, so a causal (or bidirectional) export would fail here."""
  overrides = dict(LAYOUTS[layout], **{'model.attention_mask': kind, 'model.block_size': 8})
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  ours = {}
  for other in ('bidirectional', 'causal', 'block_causal'):
    config = tiny_run.tiny_config(**dict(overrides, **{'model.attention_mask': other}))
    ours[other] = _ours(config, tiny_run.random_params(config), tokens)
  config, _, _ = tiny_run.make_run(tmp_path / 'run', **overrides)
  out = str(tmp_path / 'hf')
  assert _to_hf(str(tmp_path / 'run'), out) == 0
  model = _transformers(out, trust_remote_code=True)
  family_class = next(c for c in type(model).__mro__ if not c.__name__.startswith('Dlmjax'))
  assert type(model).__name__ == {'block_causal': 'DlmjaxBlock'}.get(kind, 'Dlmjax') + (
    family_class.__name__
  )
  theirs = _theirs(model, tokens)
  assert _rel(theirs, ours[kind]) <= 1e-4
  for other in set(ours) - {kind}:
    assert _rel(theirs, ours[other]) > 1e-2, other
  if kind != 'block_causal':
    assert _rel(_theirs(_transformers(out), tokens), ours[kind]) <= 1e-4
  else:  # plain transformers has no block-causal mask: it refuses, naming the flag
    with pytest.raises(ValueError, match='trust_remote_code=True'):
      _transformers(out)
