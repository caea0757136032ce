"""The tiny run configs the stage tests share: each stage as a user runs it, in a few steps."""

import os

from dlmjax import config as config_lib
from tests.conftest import tiny_test_config

ROOT = os.path.join(os.path.dirname(__file__), '..')


def with_cache(config):
  """Built corpora and tokenizers from $DLMJAX_CACHE_DIR, when the suite sets it."""
  if os.environ.get('DLMJAX_CACHE_DIR'):
    config.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return config


def sft_config(init_from, output_dir, train_file, **overrides):
  """configs/sft.py as a user runs it: no model keys, a few steps on a small jsonl."""
  c = config_lib.load_file(os.path.join(ROOT, 'configs', 'sft.py'))
  c.init_from, c.output_dir, c.sft.train_file = str(init_from), str(output_dir), train_file
  c.train.steps, c.train.global_batch_size, c.train.micro_batch_size = 2, 16, 8
  c.train.warmup_steps, c.train.wsd_decay_steps, c.log.every = 0, 1, 1
  return with_cache(config_lib.apply_overrides(c, overrides))


def rl_config(tmp_path, init_dir, **overrides):
  """Stage rl from init_dir: two steps of d1 over 16 prompts, 4 completions each."""
  c = tiny_test_config(
    **{
      'model.seq_len': 64,
      'train.global_batch_size': 16,
      'train.micro_batch_size': 8,
      'train.schedule': 'constant',
      'train.warmup_steps': 0,
      'train.steps': 2,
      'stage': 'rl',
      'init_from': init_dir,
      'output_dir': str(tmp_path / 'rl'),
      'rl.num_prompts': 16,
      'rl.max_prompt_tokens': 32,
      'sampler.gen_length': 16,
      'sampler.steps': 2,
      'sampler.block_length': 16,
      'rl.group_size': 4,
      'rl.inner_updates': 2,
      'log.outputs': '',
      **overrides,
    }
  )
  return c
