"""Every stage on every family: configs/sft.py and configs/rl.py start (--config.init_from) from a
tiny random-weight directory of each family as its own code lays it out (tests/checkpoint/
family_dirs.py: LLaDA's model.transformer.* names, Dream's DreamModel with its shifted
prediction, SDAR's block-causal Qwen3, transformers' Qwen2 with q/k/v biases and Llama), one step
each, and then: generate applies the run's chat template, the likelihood evaluates, the run
exports back to the family's own layout (`convert to-hf`, layout `source`) and `verify --hf-dir`
finds the export's tensors equal to the run's and its PyTorch forward equal to ours.

A family's risk is its imported model's forward, backward and export, which SFT, generate, the
likelihood and verify exercise on every family. RL's family-specific part is only that the stage
accepts the imported options, so a full RL run (one rollout, one update, its export verified) is
spent on LLaDA (what the RL papers start from; tied head, GQA, q/k/v biases, padded embedding)
and Dream (shifted prediction and q/k/v biases: the most options away from the defaults). SDAR,
Qwen2 and Llama build the RL stage only (adopt the options, validate, shape the state, build the
stage: nothing compiles), so an RL bug that only a block-causal mask or an untied, bias-free
model shows in the rollout or update would pass here; a family without the RL run costs ~17 s of
CPU, one with it ~30-45 s (the RL run compiles the rollout, its log-probabilities and the update).

One test per family: a family's compiled programs serve no other family, so its stages run back
to back on one directory, at one model shape (seq_len 32), with one verify (of the export).
"""

import json
import os
import re

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import convert
from dlmjax import evaluate
from dlmjax import generate
from dlmjax import verify
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import manager
from dlmjax.checkpoint import init_from as init_from_lib
from dlmjax.data import chat
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import loop, stages
from dlmjax.train import state as state_lib
from tests.checkpoint import family_dirs

ROOT = os.path.join(os.path.dirname(__file__), '..')
# The RL rollout's sampler settings, which generate repeats.
_SAMPLER = {'sampler.gen_length': 8, 'sampler.steps': 1, 'sampler.block_length': 8}
_FLAGS = ['--gen-length', '8', '--steps', '1', '--block-length', '8']
RL_RUNS = ('llada', 'dream')  # the families whose RL stage trains (the module docstring says why)

# family: (its directory, chat template, (qk_norm, qkv_bias, shift_logits, attention_mask) as the
# import must adopt them, the export's config.json model_type).
FAMILIES = {
  'llada': (
    lambda d: family_dirs.llada_dir(d, 'gqa_tied_qkv_bias_padded')[0],
    'llada',
    (False, True, False, 'bidirectional'),
    'llada',
  ),
  'dream': (
    lambda d: family_dirs.dream_dir(d)[0],
    'dream',
    (False, True, True, 'bidirectional'),
    'Dream',
  ),
  # SDAR exports as Qwen3 (its tensors) with dlmjax's modeling file, block-causal mask recorded.
  'sdar': (family_dirs.sdar_dir, 'chatml', (True, False, False, 'block_causal'), 'qwen3'),
  'qwen2': (
    lambda d: family_dirs.transformers_dir(d, 'qwen2'),
    'chatml',
    (False, True, False, 'bidirectional'),
    'qwen2',
  ),
  'llama': (
    lambda d: family_dirs.transformers_dir(d, 'llama'),
    'plain',
    (False, False, False, 'bidirectional'),
    'llama',
  ),
}
PARITY = {}  # family -> verify's logits-parity line (the max |dlogit| figure), printed with -s.


def _stage(name, init_from, output_dir, **overrides):
  """configs/NAME.py as a user runs it from a model directory: no model keys, one step."""
  c = config_lib.load_file(os.path.join(ROOT, 'configs', f'{name}.py'))
  c.init_from, c.output_dir = str(init_from), str(output_dir)
  c.train.steps, c.train.global_batch_size, c.train.micro_batch_size = 1, 8, 8  # 8 host devices
  c.train.warmup_steps, c.train.wsd_decay_steps, c.log.every, c.checkpoint.every = 0, 1, 1, 0
  if 'DLMJAX_CACHE_DIR' in os.environ:
    c.data.cache_dir = os.environ['DLMJAX_CACHE_DIR']
  return config_lib.apply_overrides(c, {'model.seq_len': 32, **overrides})


def _train_file(directory):
  rows = [json.dumps({'prompt': f't{i} t{i + 1}', 'response': f't{i + 2}'}) for i in range(8)]
  path = os.path.join(directory, 'sft.jsonl')
  with open(path, 'w') as f:
    f.write('\n'.join(rows) + '\n')
  return path


def _options(config):
  m = config.model
  return (m.qk_norm, m.qkv_bias, m.shift_logits, m.attention_mask)


def _build_rl_stage(config):
  """What the RL run does before it compiles: adopt the source's model keys, validate the run
  (make_mesh), shape the state and build the stage."""
  init_from_lib.adopt_source_config(config)
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  assert stages.build(config).name == 'rl' and setup.model_config.num_params() > 0


@pytest.mark.slow  # ~17 s of CPU a family (~30-45 s with the RL run): every stage compiles.
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_every_stage_runs_from_a_family_directory_and_exports_back(
  tmp_path, family, capsys, monkeypatch
):
  build, template, options, model_type = FAMILIES[family]
  hf_dir = build(tmp_path / 'hf')

  run_dir = tmp_path / 'sft'
  sft = _stage(
    'sft',
    hf_dir,
    run_dir,
    **{'sft.chat_template': template, 'sft.train_file': _train_file(str(tmp_path))},
  )
  row = loop.train(sft)
  assert row['step'] == 1 and np.isfinite(row['loss'])
  saved = manager.load_run_config(str(run_dir))
  assert _options(saved) == options  # import
  assert saved.sft.chat_template == template

  rl = _stage(
    'rl',
    hf_dir,
    tmp_path / 'rl',
    **{
      'rl.max_prompt_tokens': 16,
      'rl.group_size': 4,
      'rl.inner_updates': 1,  # one rollout, one optimizer step on it
      'rl.num_prompts': 8,
      'sft.chat_template': template,
      **_SAMPLER,
    },
  )
  if family in RL_RUNS:
    run_dir = tmp_path / 'rl'  # the later stages read the RL run
    row = loop.train(rl)
    assert row['step'] == 1 and np.isfinite(row['loss'])
    assert _options(manager.load_run_config(str(run_dir))) == options
  else:
    _build_rl_stage(rl)
    assert _options(rl) == options

  # generate wraps the prompt in the run's chat template.
  rendered = []
  prompt_text = chat.prompt_text
  monkeypatch.setattr(chat, 'prompt_text', lambda t, u: rendered.append(t) or prompt_text(t, u))
  capsys.readouterr()
  out = tmp_path / 'gen.jsonl'
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(json.dumps({'prompt': 't3 t4'}) + '\n')
  argv = ['--checkpoint-path', str(run_dir), '--prompts-file', str(prompts), '--output', str(out)]
  assert generate.main(argv + _FLAGS) == 0, capsys.readouterr()
  generated = json.loads(out.read_text().splitlines()[0])
  assert isinstance(generated['completion'], str) and rendered == [template]

  data = tmp_path / 'rows.jsonl'
  data.write_text(json.dumps({'context': 't1 t2', 'continuation': ' t3'}) + '\n')
  argv = ['--checkpoint-path', str(run_dir), '--batch-size', '1', 'likelihood', '--data', str(data)]
  assert evaluate.main(argv + ['--mc-num', '1', '--mc-batch', '1']) == 0, capsys.readouterr()

  # Back to the family's own layout; verify --hf-dir: the export holds the run's tensors and its
  # PyTorch forward (transformers' class, or the Reference of the family's formulas) gives ours.
  export = str(tmp_path / 'export')
  argv = ['to-hf', '--checkpoint-path', str(run_dir), '--output-dir', export, '--dtype', 'fp32']
  assert convert.main(argv) == 0, capsys.readouterr()
  assert hf_config.read(export)['model_type'] == model_type
  capsys.readouterr()
  assert verify.main(['--checkpoint-path', str(run_dir), '--hf-dir', export]) == 0
  report = capsys.readouterr().out
  parity = re.search(r'\[PASS\] logits parity: (.*)', report)
  assert parity, report
  PARITY[family] = parity.group(1)
  print(f'{family}: {PARITY[family]}')
