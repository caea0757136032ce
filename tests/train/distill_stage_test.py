"""The distillation stage end to end on a tiny teacher: its rows (dlmjax.distill) in the SFT
layout with the commit steps, then sft.objective training on them (block-causal, LoRA)."""

import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import distill as distill_cli
from dlmjax import inference
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.data import teacher_rows
from dlmjax.data.errors import DataError
from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from dlmjax.diffusion import sampling_config
from dlmjax.train import loop
from tests import stage_configs
from tests.checkpoint import tiny_run

GEN, STEPS = 16, 8
BLOCK_CAUSAL = {
  'model.attention_mask': 'block_causal',
  'model.block_size': 4,
  'diffusion.objective': 'block',
}


@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
  """A block-causal params-only run and the rows it decodes for 16 prompts of 3-9 tokens."""
  root = tmp_path_factory.mktemp('distill')
  tiny_run.make_run(root / 'teacher', **BLOCK_CAUSAL)
  pretrained = inference.load_pretrained(str(root / 'teacher'))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(10, 200, rng.integers(3, 10))) for _ in range(16)]
  sampling = sampling_config.SamplingConfig(
    gen_length=GEN, steps=STEPS, block_length=GEN, temperature=0.0, cache='none'
  )
  rows = distill_cli.build_rows(pretrained, prompts, sampling, batch_size=8, seed=0)
  path = teacher_rows.write(str(root / 'rows.npz'), rows)
  return root, prompts, pretrained.config.model.eos_token_id, path


def test_teacher_rows_are_prompt_then_completion_with_its_commit_steps(teacher):
  root, prompts, eos, path = teacher
  rows = teacher_rows.read(path, 33)
  for i, prompt in enumerate(prompts):
    n = len(prompt)
    tokens, roles, steps = rows['tokens'][i], rows['roles'][i], rows['commit_steps'][i]
    assert list(tokens[:n]) == prompt and (roles[:n] == PROMPT).all()
    assert (steps[:n] == -1).all() and (steps[n + GEN :] == -1).all()
    assert (steps[n : n + GEN] >= 0).all()  # every completion token was committed by a step
    eos_at = np.flatnonzero(tokens[n : n + GEN] == eos)
    answer = eos_at[0] + 1 if len(eos_at) else GEN
    assert (roles[n : n + answer] == RESPONSE).all() and (roles[n + answer :] == PADDING).all()
  with pytest.raises(DataError, match='not model.seq_len \\+ 1 = 65'):
    teacher_rows.read(path, 65)


def _distill_config(root, path, name='student', **overrides):
  c = stage_configs.sft_config(
    root / 'teacher',
    root / name,
    '',
    **{'sft.objective': 'trajectory', 'sft.teacher_file': path, 'sampler.block_length': 8},
  )
  return config_lib.apply_overrides(c, overrides)


def test_a_distilling_objective_needs_its_teacher_rows(teacher, tmp_path):
  root, _, _, path = teacher
  c = _distill_config(root, '')
  with pytest.raises(config_lib.ConfigError, match='set --config.sft.teacher_file'):
    config_lib.validate(c)
  c = _distill_config(root, path, **{'data.packing': True})
  with pytest.raises(config_lib.ConfigError, match='data.packing=False'):
    config_lib.validate(c)
  c = _distill_config(root, str(tmp_path / 'missing.npz'))
  c.sft.train_file = str(tmp_path / 'not_read.jsonl')  # the teacher's rows replace it
  with pytest.raises(DataError, match="teacher_file .*missing.npz' is not a file"):
    loop.train(c)


@pytest.mark.slow  # ~25 s on 2 cores: it compiles the two-stream LoRA step
def test_trajectory_distillation_trains_lora_on_a_block_causal_teacher(teacher):
  root, _, _, path = teacher
  lora = {'train.lora.rank': 4, 'train.lora.base_dtype': 'float32'}
  c = _distill_config(root, path, 'lora_student', **lora)
  last = loop.train(c)
  with open(os.path.join(c.output_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if 'loss' in line]
  assert last['step'] == 2 and [r['step'] for r in rows] == [1, 2]
  for row in rows:
    assert np.isfinite(row['loss']) and np.isfinite(row['certainty']), row
    assert 0 < row['masked_tokens'] < row['response_tokens']  # the block, not the whole answer
  saved = run_dir_lib.load_run_config(c.output_dir)
  assert saved.sft.objective == 'trajectory' and saved.model.attention_mask == 'block_causal'
