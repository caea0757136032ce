"""A tiny MoE through every stage: pre-training with both router losses, SFT from it (which
adopts the experts from the run), RL with the router losses switched on, then generate and the
likelihood on the RL run. The router metrics reach metrics.jsonl."""

import json

import numpy as np
import pytest

from dlmjax import evaluate, generate
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.observability import plots
from dlmjax.train import loop
from tests import stage_configs
from tests.conftest import tiny_test_config
from tests.model.moe_test import TINY_MOE

# The tokenizer's vocabulary stays (the stages read text); one layer, 32 positions.
MOE = {
  **{k: v for k, v in TINY_MOE.items() if k != 'model.vocab_size'},
  'model.num_layers': 1,
  'model.seq_len': 32,
  'model.moe.router': 'softmax_topk_raw',
  'model.moe.balance_loss': 0.01,
  'model.moe.z_loss': 0.001,
}
# One sampler shape for RL's rollouts and generate.
SAMPLER = {'sampler.gen_length': 8, 'sampler.steps': 2, 'sampler.block_length': 8}


def _rows(run_dir):
  return [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]


@pytest.mark.slow  # three stages' steps, the RL sampler and the scorer compile
def test_moe_pretrain_sft_rl_generate_and_likelihood(tmp_path, capsys):
  pre_dir = tmp_path / 'pretrain'
  c = stage_configs.with_cache(
    tiny_test_config(
      **MOE,
      **{
        'train.steps': 1,
        'train.global_batch_size': 8,  # one micro-batch
        'train.micro_batch_size': 8,
        'train.warmup_steps': 0,
        'train.wsd_decay_steps': 1,
        'diffusion.varlen_prob': 0.0,
        'output_dir': str(pre_dir),
      },
    )
  )
  loop.train(c)
  row = _rows(pre_dir)[-1]
  assert row['moe_load_max'] >= 1.0 >= row['moe_load_min']
  assert np.isclose(sum(row[f'moe_load_e{j}'] for j in range(4)), 1.0)
  assert row['moe_balance_loss'] >= 2.0 * 0.99  # k at perfect balance, more otherwise
  # Pre-training's loss stays the diffusion loss; the router losses' part is logged beside it.
  router = 0.01 * row['moe_balance_loss'] + 0.001 * row['moe_z_loss']
  assert np.isclose(row['moe_router_loss'], router, rtol=1e-5)
  assert any(p.endswith('router.png') for p in plots.draw(str(pre_dir)))

  train_file = tmp_path / 'sft.jsonl'
  train_file.write_text(
    '\n'.join(json.dumps({'prompt': f'{i}+1?', 'response': str(i + 1)}) for i in range(16))
  )
  sft_dir = tmp_path / 'sft'
  sft = stage_configs.sft_config(
    pre_dir, sft_dir, str(train_file), **{'model.seq_len': 32, 'train.steps': 1}
  )
  sft.train.global_batch_size = sft.train.micro_batch_size = 8
  loop.train(sft)
  saved = run_dir_lib.load_run_config(str(sft_dir))
  assert (saved.model.moe.num_experts, saved.model.moe.router) == (4, 'softmax_topk_raw')
  assert 'moe_entropy' in _rows(sft_dir)[-1]

  rl = stage_configs.rl_config(
    tmp_path,
    str(sft_dir),
    **{
      **MOE,  # the model's keys as saved, and the router losses' weights
      **SAMPLER,
      'rl.max_prompt_tokens': 32,
      'model.seq_len': 40,  # countdown prompts need 32 positions, the rollout 8 more
      'rl.router_losses': True,
      'rl.inner_updates': 1,
      'rl.num_prompts': 4,
      'train.global_batch_size': 8,  # one rollout of 2 prompts x 4, one micro-batch
      'train.micro_batch_size': 8,
      'train.steps': 1,
    },
  )
  row = loop.train(rl)
  assert row['step'] == 1 and np.isfinite(row['loss'])
  # The router losses entered the objective: without them this untrained policy gets no reward,
  # no advantage and so no gradient at all.
  assert row['reward_mean'] == 0.0 and row['grad_norm'] > 0
  # ... and RL's logged loss is that objective: here the router losses' part alone.
  router = 0.01 * row['moe_balance_loss'] + 0.001 * row['moe_z_loss']
  assert row['moe_router_loss'] > 0 and np.isclose(row['moe_router_loss'], router, rtol=1e-5)
  assert np.isclose(row['loss'], router, rtol=1e-4, atol=1e-7)

  rl_dir = tmp_path / 'rl'
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(json.dumps({'prompt': '3+1?'}) + '\n')
  out = tmp_path / 'gen.jsonl'
  argv = ['--checkpoint-path', str(rl_dir), '--prompts-file', str(prompts), '--output', str(out)]
  sampler = ['--gen-length', '8', '--steps', '2', '--block-length', '8']
  assert generate.main(argv + sampler) == 0, capsys.readouterr()
  assert isinstance(json.loads(out.read_text().splitlines()[0])['completion'], str)

  data = tmp_path / 'rows.jsonl'
  data.write_text(json.dumps({'context': '3+1?', 'continuation': ' 4'}) + '\n')
  argv = ['--checkpoint-path', str(rl_dir), '--batch-size', '2', 'likelihood', '--data', str(data)]
  assert evaluate.main(argv + ['--mc-num', '2', '--mc-batch', '2']) == 0, capsys.readouterr()
