"""diffusion.objective=block end to end: a tiny run learns, resumes exactly, counts real tokens."""

import json
import os
import shutil


from dlmjax.train import loop
from tests.conftest import tiny_test_config


def _config(output_dir, **overrides):
  c = tiny_test_config(
    **{
      'diffusion.objective': 'block',
      'model.attention_mask': 'block_causal',
      'model.block_size': 4,
      'model.num_layers': 1,
      'model.d_model': 32,
      'model.num_heads': 2,
      'model.num_kv_heads': 1,
      'model.ffn_dim': 64,
      'model.seq_len': 16,
      'train.global_batch_size': 8,
      'train.micro_batch_size': 8,
      'data.packing': True,
      'diffusion.varlen_prob': 0.3,
      'train.steps': 4,
      'checkpoint.every': 2,
      'checkpoint.keep': 5,
      **overrides,
    }
  )
  c.output_dir = str(output_dir)
  if os.environ.get('DLMJAX_CACHE_DIR'):
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return c


def _rows(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return {row['step']: row for row in map(json.loads, f)}


def test_block_run_resumes_exactly_and_counts_real_tokens(tmp_path):
  # The resumed run reuses the straight run's compiled step through the suite's one persistent
  # compilation cache (tests/conftest.py).
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  loop.train(_config(straight))
  expected = _rows(straight)
  # The run as it stood at its step-2 save: resuming from there must redo steps 3-4 exactly.
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / 'checkpoints' / '4')
  loop.train(_config(resumed))
  got = _rows(resumed)
  assert [got[s]['loss'] for s in (3, 4)] == [expected[s]['loss'] for s in (3, 4)]
  # tokens: the real tokens of the step (rows x kept length), not the doubled [x_t || x_0].
  assert all(expected[s]['tokens'] <= 8 * 16 for s in expected)
  assert expected[4]['loss'] < expected[1]['loss']
