"""Every stage on every family: configs/sft.py starts (--config.init_from) from a tiny
random-weight directory of each family as its own code lays it out (tests/checkpoint/
family_dirs.py: LLaDA's model.transformer.* names, Dream's DreamModel with its shifted
prediction, SDAR's block-causal Qwen3, transformers' Qwen2 with q/k/v biases and Llama), and
configs/rl.py from that SFT run, as a user chains them; one step each (RL: one rollout, one
update). Then: generate applies the run's chat template, the likelihood evaluates, and the RL
run exports back to the family's own layout (`convert to-hf`, layout `source`), which re-imports
to the run's params bit for bit, or (LLaDA, Dream: VERIFIED) on which `verify --hf-dir` finds the
run's tensors and its PyTorch forward equal to ours.

One test per family: a family's compiled programs serve no other family, so its stages run back
to back on one directory, at one model shape (seq_len 32).
Within a family, generate's sampler is the RL rollout's (the same settings, so one compile).
The RL stage runs without its KL term (rl.kl_beta 0): the reference is the SFT model's forward
again, which the rollout's log-probabilities already exercise (tests/rl cover the KL itself);
and no run draws plots or writes tensorboard (tests/observability cover those).
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
from dlmjax import model as model_lib
from dlmjax import verify
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.data import chat
from dlmjax.train import loop
from tests.checkpoint import family_dirs
from tests.checkpoint import tiny_run

ROOT = os.path.join(os.path.dirname(__file__), '..')
# The RL rollout's sampler settings, which generate repeats.
_SAMPLER = {'sampler.gen_length': 8, 'sampler.steps': 1, 'sampler.block_length': 8}
_FLAGS = ['--gen-length', '8', '--steps', '1', '--block-length', '8']

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
  'sdar': (family_dirs.sdar_dir, 'chatml', (True, False, False, 'block_causal'), 'sdar'),
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
# The families whose export `verify` checks here (integrity, and the PyTorch forward of the
# export): the RL papers' starts. The other layouts' forwards are checked on their exports by
# tests/verify_test.py (Qwen2, Llama, SDAR) and tests/convert_sdar_test.py; here their trained
# export re-imports bit for bit. verify costs ~8 s of CPU a family (its checksums recompile for
# the restored placement, and the forward compiles).
VERIFIED = ('llada', 'dream')
PARITY = {}  # family -> verify's logits-parity line (the max |dlogit| figure), printed with -s.


def _stage(name, init_from, output_dir, **overrides):
  """configs/NAME.py as a user runs it from a model directory: no model keys, one step."""
  c = config_lib.load_file(os.path.join(ROOT, 'configs', f'{name}.py'))
  c.init_from, c.output_dir = str(init_from), str(output_dir)
  c.train.steps, c.train.global_batch_size, c.train.micro_batch_size = 1, 8, 8  # 8 host devices
  c.train.warmup_steps, c.train.wsd_decay_steps, c.log.every, c.checkpoint.every = 0, 1, 1, 0
  c.log.outputs = ''  # no tensorboard or plots: matplotlib alone cost ~2 s of CPU a run
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


@pytest.mark.slow  # ~30 s of CPU a family: every stage compiles.
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
  saved = run_dir_lib.load_run_config(str(run_dir))
  assert _options(saved) == options  # import
  assert saved.sft.chat_template == template

  sft_dir, run_dir = run_dir, tmp_path / 'rl'  # the later stages read the RL run
  rl = _stage(
    'rl',
    sft_dir,
    run_dir,
    **{
      'rl.max_prompt_tokens': 16,
      'rl.group_size': 4,
      'rl.inner_updates': 1,  # one rollout, one optimizer step on it
      'rl.kl_beta': 0.0,  # no KL reference: a second restore and forward of the same model
      'rl.num_prompts': 8,
      'sft.chat_template': template,
      **_SAMPLER,
    },
  )
  row = loop.train(rl)
  assert row['step'] == 1 and np.isfinite(row['loss'])
  assert _options(run_dir_lib.load_run_config(str(run_dir))) == options

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

  # Back to the family's own layout, which re-imports to the RL run's params bit for bit.
  export = str(tmp_path / 'export')
  argv = ['to-hf', '--checkpoint-path', str(run_dir), '--output-dir', export, '--dtype', 'fp32']
  assert convert.main(argv) == 0, capsys.readouterr()
  assert hf_config.read(export)['model_type'] == model_type
  if family not in VERIFIED:
    config = run_dir_lib.load_run_config(str(run_dir))
    _, step_dir, _ = run_dir_lib.resolve_step_dir(str(run_dir))
    params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))
    tiny_run.assert_same_params(params, hf_io.load_hf(export)[1])
    return
  # verify --hf-dir: the export holds the run's tensors and its PyTorch forward (transformers'
  # class, or the Reference of the family's formulas) gives ours.
  capsys.readouterr()
  assert verify.main(['--checkpoint-path', str(run_dir), '--hf-dir', export]) == 0
  report = capsys.readouterr().out
  parity = re.search(r'\[PASS\] logits parity: (.*)', report)
  assert parity, report
  PARITY[family] = parity.group(1)
  print(f'{family}: {PARITY[family]}')
