"""A LoRA run loads wherever a run loads: load_pretrained (merged or not), init_from, verify and
convert give the run's own model, the base joined to its adapters; a mismatched checkpoint says
what differs. The LoRA run is built directly (adapters with B != 0 saved beside the record of
their base), so no training step compiles."""

import json
import os

import jax
import numpy as np
import pytest

import dlmjax
from dlmjax import model as model_lib
from dlmjax import verify as verify_lib
from dlmjax.checkpoint import lora_checkpoint, params_checkpoint, run_model
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.model import lora
from tests.checkpoint import tiny_run

_LORA = {
  'train.lora.rank': 4,
  'train.lora.alpha': 8.0,
  'train.lora.targets': 'q,v,o,up,down',
  'train.lora.base_dtype': 'float32',
}


@pytest.fixture(scope='module')
def lora_run(tmp_path_factory):
  """(base run dir, LoRA run dir, adapters, base params) of a LoRA run that moved its adapters."""
  base_dir = tmp_path_factory.mktemp('base')
  _, base, _ = tiny_run.make_run(base_dir, seed=1)
  run_dir = tmp_path_factory.mktemp('lora')
  config = tiny_run.tiny_config(init_from=str(base_dir), **_LORA)
  config.output_dir = str(run_dir)
  cfg = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  adapter_shapes = lora.split(model_lib.abstract(cfg)[1])[0]
  rng = np.random.default_rng(2)
  adapters = jax.tree.map(
    lambda s: np.asarray(0.3 * rng.standard_normal(s.shape), np.float32), adapter_shapes
  )
  params_checkpoint.save_params_checkpoint(str(run_dir), config, adapters, step=3)
  frozen = lora.freeze(base, cfg, lora.storage_dtype(config))
  with open(os.path.join(run_dir, lora_checkpoint.BASE_FILE), 'w') as f:
    json.dump(lora_checkpoint.base_record(str(base_dir), frozen), f)
  return str(base_dir), str(run_dir), adapters, base, config


def _merged_logits(lora_run, tokens):
  """The run's own merged model (model/lora.py's merge_into_base) over the base's config."""
  _, _, adapters, base, config = lora_run
  cfg = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  merged = lora.merge_into_base(lora.combine(adapters, base), cfg.lora_spec)
  plain_cfg = model_lib.ModelConfig.from_config(config)
  return np.asarray(model_lib.merge(plain_cfg, merged)(tokens)), plain_cfg


TOKENS = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)


def test_load_pretrained_of_a_lora_run_is_its_merged_model(lora_run):
  expected, plain_cfg = _merged_logits(lora_run, TOKENS)
  base_logits = np.asarray(model_lib.merge(plain_cfg, lora_run[3])(TOKENS))
  tol = 1e-5 * np.abs(expected).max()
  assert np.abs(expected - base_logits).max() > 100 * tol  # the adapters matter
  merged = dlmjax.load_pretrained(lora_run[1])
  assert merged.config.train.lora.rank == 0 and merged.model_config.lora_rank == 0
  np.testing.assert_allclose(merged.logits(TOKENS), expected[..., :256], rtol=0, atol=tol)
  kept = dlmjax.load_pretrained(lora_run[1], merge_lora=False)  # base + adapters, as trained
  assert kept.model_config.lora_rank == 4 and any(
    lora.is_adapter(str(p[-1].key)) for p, _ in jax.tree_util.tree_flatten_with_path(kept.params)[0]
  )
  np.testing.assert_allclose(kept.logits(TOKENS), expected[..., :256], rtol=0, atol=tol)


def test_init_from_a_lora_run_starts_from_its_merged_model(lora_run):
  expected, plain_cfg = _merged_logits(lora_run, TOKENS)
  for rank in (0, 4):  # a full fine-tune of the merged weights, or a new LoRA over them
    config = tiny_run.tiny_config(init_from=lora_run[1], **{**_LORA, 'train.lora.rank': rank})
    params = run_model.source_params(config, purpose=None)
    logits = np.asarray(model_lib.merge(plain_cfg, params)(TOKENS))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_verify_and_to_torch_read_a_lora_run(lora_run, tmp_path):
  checks = verify_lib.verify(lora_run[1], parity=False)
  assert all(c.ok for c in checks), verify_lib.report(checks)
  assert any(c.name == 'LoRA base' for c in checks)
  from dlmjax import convert  # pylint: disable=import-outside-toplevel

  torch = pytest.importorskip('torch')
  out = str(tmp_path / 'lora.pt')
  assert convert.main(['to-torch', '--checkpoint-path', lora_run[1], '--output', out]) == 0
  state = torch.load(out, weights_only=False)['state_dict']
  run = run_model.restore(lora_run[1])
  q = np.asarray(run.params['blocks']['attn']['q_proj'])[0]
  name = next(n for n in state if n.endswith('layers.0.self_attn.q_proj.weight'))
  np.testing.assert_allclose(state[name].numpy(), q.reshape(q.shape[0], -1).T, atol=1e-6)


def test_a_mismatched_checkpoint_says_what_differs(lora_run, tmp_path):
  _, run_dir, _, _, config = lora_run
  step_dir = run_dir_lib.resolve_step_dir(run_dir)[1]
  with pytest.raises(run_dir_lib.CheckpointError) as e:  # adapters read as a whole model
    params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))
  assert 'adapters of a LoRA run' in str(e.value) and 'edited' not in str(e.value)
  wider = tiny_run.tiny_config(**{'model.ffn_dim': 192})
  with pytest.raises(run_dir_lib.CheckpointError) as e:  # a plain run read as another model
    params_checkpoint.restore_params(
      run_dir_lib.resolve_step_dir(lora_run[0])[1], *model_lib.param_placement(wider)
    )
  assert 'shaped otherwise' in str(e.value) and 'up_proj' in str(e.value)
  assert '\n' not in str(e.value)
