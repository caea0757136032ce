"""Every stage on every family: configs/sft.py and configs/rl.py start (--config.init_from) from a
tiny random-weight LLaDA directory (model.transformer.* names) and a transformers Qwen2 directory
(q/k/v biases), run two steps each, and what they save verifies, generates and evaluates.

LLaDA is fine-tuned with its own chat template (sft.chat_template=llada), which generate then
applies from the run's config. One test per family: the SFT run's compiled programs are reused by
nothing else, so the stages run back to back on one directory.
"""

import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import evaluate
from dlmjax import generate
from dlmjax import verify
from dlmjax.checkpoint import manager
from dlmjax.data import chat
from dlmjax.train import loop
from tests.checkpoint import family_dirs

ROOT = os.path.join(os.path.dirname(__file__), '..')
_SAMPLER = ['--gen-length', '8', '--steps', '2', '--block-length', '8']


def _family_dir(directory, family):
  if family == 'llada':
    return family_dirs.llada_dir(directory, 'gqa_tied_qkv_bias_padded')[0]
  return family_dirs.transformers_dir(directory, family)


def _stage(name, init_from, output_dir, **overrides):
  """configs/NAME.py as a user runs it from a model directory: no model keys, two steps."""
  c = config_lib.load_file(os.path.join(ROOT, 'configs', f'{name}.py'))
  c.init_from, c.output_dir = str(init_from), str(output_dir)
  c.train.steps, c.train.global_batch_size, c.train.micro_batch_size = 2, 8, 8
  c.train.warmup_steps, c.train.wsd_decay_steps, c.log.every, c.checkpoint.every = 0, 1, 1, 0
  if 'DLMJAX_CACHE_DIR' in os.environ:
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return config_lib.apply_overrides(c, {'model.seq_len': 32, **overrides})


def _train_file(directory):
  rows = [json.dumps({'prompt': f't{i} t{i + 1}', 'response': f't{i + 2}'}) for i in range(16)]
  path = os.path.join(directory, 'sft.jsonl')
  with open(path, 'w') as f:
    f.write('\n'.join(rows) + '\n')
  return path


def _verified(run_dir, capsys):
  capsys.readouterr()
  assert verify.main(['--checkpoint-path', str(run_dir)]) == 0, capsys.readouterr().out
  assert '[PASS] logits parity' in capsys.readouterr().out


@pytest.mark.slow  # ~40 s of CPU a family: each stage compiles its step (and RL its sampler).
@pytest.mark.parametrize('family,template', [('llada', 'llada'), ('qwen2', 'chatml')])
def test_sft_rl_generate_evaluate_and_verify_from_a_family_directory(
  tmp_path, family, template, capsys, monkeypatch
):
  hf_dir = _family_dir(tmp_path / 'hf', family)

  sft_dir = tmp_path / 'sft'
  sft = _stage(
    'sft',
    hf_dir,
    sft_dir,
    **{'sft.chat_template': template, 'sft.train_file': _train_file(str(tmp_path))},
  )
  row = loop.train(sft)
  assert row['step'] == 2 and np.isfinite(row['loss'])
  saved = manager.load_run_config(str(sft_dir))
  assert (saved.model.qk_norm, saved.model.qkv_bias) == (False, True)  # the family's options
  assert saved.sft.chat_template == template
  _verified(sft_dir, capsys)

  rl_dir = tmp_path / 'rl'
  rl = _stage(
    'rl',
    hf_dir,
    rl_dir,
    **{
      'model.seq_len': 64,
      'rl.max_prompt_tokens': 16,
      'rl.group_size': 4,
      'rl.inner_updates': 2,  # one rollout, two optimizer steps on it
      'rl.num_prompts': 8,
      'sampler.gen_length': 16,
      'sampler.steps': 2,
      'sampler.block_length': 16,
      'sft.chat_template': template,
    },
  )
  row = loop.train(rl)
  assert row['step'] == 2 and np.isfinite(row['loss'])
  _verified(rl_dir, capsys)

  # generate on the SFT run wraps the prompt in the template it was fine-tuned with.
  rendered = []
  prompt_text = chat.prompt_text
  monkeypatch.setattr(chat, 'prompt_text', lambda t, u: rendered.append(t) or prompt_text(t, u))
  capsys.readouterr()
  out = tmp_path / 'gen.jsonl'
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(json.dumps({'prompt': 't3 t4'}) + '\n')
  argv = ['--checkpoint-path', str(sft_dir), '--prompts-file', str(prompts), '--output', str(out)]
  assert generate.main(argv + _SAMPLER) == 0, capsys.readouterr()
  generated = json.loads(out.read_text().splitlines()[0])
  assert isinstance(generated['completion'], str) and rendered == [template]

  data = tmp_path / 'rows.jsonl'
  data.write_text(json.dumps({'context': 't1 t2', 'continuation': ' t3'}) + '\n')
  argv = ['--checkpoint-path', str(rl_dir), '--batch-size', '2', 'likelihood', '--data', str(data)]
  assert evaluate.main(argv + ['--mc-num', '2', '--mc-batch', '2']) == 0, capsys.readouterr()
