"""Training on the LLaDA2 family from a directory laid out as it ships (tests/checkpoint/
family_dirs.py llada2_dir: fused query_key_value, grouped sigmoid router with expert bias, a dense
first layer, a shared expert): block-diffusion SFT as dFactory's train_llada2_bd trains it (the
[x_t || x_0] stream under the block-diffusion mask over the family's block size; configs/sft.py
with diffusion.objective=block), full fine-tuning and LoRA, then RL on the block model with
TraceRL and d1. The loss falls; a full run moves the weights, a LoRA run only its adapters."""

import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_io, run_model
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.train import loop
from tests import stage_configs
from tests.checkpoint import family_dirs

# The family's own block size (LLADA2_CONFIG block_size 4) is what the import adopts.
SFT = {
  'diffusion.objective': 'block',
  'model.seq_len': 16,
  'train.steps': 8,
  'train.global_batch_size': 8,
  'train.micro_batch_size': 8,
  'train.lr': 3e-3,
  'train.min_lr': 3e-3,
  'train.schedule': 'constant',
  'checkpoint.every': 0,
  'log.outputs': '',
  'sft.chat_template': 'plain',
}


def _rows(run_dir):
  return [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]


def _train_file(tmp_path):
  path = tmp_path / 'sft.jsonl'
  path.write_text(
    '\n'.join(json.dumps({'prompt': f't{i % 4}', 'response': f't{i % 4}'}) for i in range(8))
  )
  return str(path)


def _leaves(params, prefix=''):
  out = {}
  for key, value in params.items():
    name = f'{prefix}/{key}'
    out.update(_leaves(value, name) if isinstance(value, dict) else {name: np.asarray(value)})
  return out


@pytest.mark.slow  # two SFT and two RL compiles of the MoE model: ~40 s of CPU on 2 cores
@pytest.mark.usefixtures('no_compile_cache_writes')  # conftest: a serialisation crash
def test_llada2_block_sft_full_and_lora_then_trace_and_d1(tmp_path):
  hf_dir, _, _ = family_dirs.llada2_dir(tmp_path / 'hf')
  train_file = _train_file(tmp_path)
  runs = {}
  for name, lora_rank in (('full', 0), ('lora', 4)):
    run_dir = tmp_path / name
    c = stage_configs.sft_config(
      hf_dir,
      run_dir,
      train_file,
      **SFT,
      **{'train.lora.rank': lora_rank, 'train.lora.base_dtype': 'float32'},
    )
    loop.train(c)
    saved = run_dir_lib.load_run_config(str(run_dir))
    assert (saved.model.attention_mask, saved.model.block_size) == ('block_causal', 4)
    assert saved.model.moe.router == 'sigmoid_bias' and saved.model.moe.router_groups == 4
    losses = [row['loss'] for row in _rows(run_dir) if 'loss' in row]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    runs[name] = run_dir

  base = _leaves(hf_io.load_hf(hf_dir)[1])
  full = _leaves(run_model.restore(str(runs['full'])).params)
  lora = _leaves(run_model.restore(str(runs['lora'])).params)  # merged into its base
  assert base.keys() == full.keys() == lora.keys()
  moved = {k for k in base if not np.array_equal(base[k], full[k])}
  assert any('experts' not in k and 'proj' in k for k in moved) and any(
    'gate_proj' in k for k in moved
  )
  # LoRA moves its targets' weights (the attention and the dense MLP), never a routed expert's.
  adapted = {k for k in base if not np.allclose(base[k], lora[k], atol=1e-6)}
  assert adapted and all(k.endswith('_proj') and 'blocks_1/mlp' not in k for k in adapted), adapted

  for objective in ('trace', 'd1'):  # configs/rl.py from the SFT run, as a user chains them
    rl = config_lib.load_file(os.path.join(stage_configs.ROOT, 'configs', 'rl.py'))
    rl.init_from, rl.output_dir = str(runs['full']), str(tmp_path / objective)
    rl = config_lib.apply_overrides(
      stage_configs.with_cache(rl),
      {
        'rl.objective': objective,
        'sampler.gen_length': 8,
        'sampler.steps': 4,
        'sampler.block_length': 4,
        'sampler.cache': 'block',
        'rl.max_prompt_tokens': 8,
        'rl.num_prompts': 8,
        'rl.group_size': 4,
        'rl.kl_beta': 0.0,
        'rl.inner_updates': 1,
        'sft.chat_template': 'plain',
        'train.steps': 1,
        'train.global_batch_size': 8,
        'train.micro_batch_size': 8,
        'train.warmup_steps': 0,
        'train.wsd_decay_steps': 1,
        'checkpoint.every': 0,
        'log.outputs': '',
      },
    )
    row = loop.train(rl)
    assert row['step'] == 1 and np.isfinite(row['loss'])
