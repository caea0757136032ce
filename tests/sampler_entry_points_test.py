"""Every entry point that samples hands the sampler every sampler setting it was given: generate,
evaluate tasks, the lm-eval adapter's generate_until, RL rollouts and RL's held-out evaluation;
every cache mode among them (block decoding's `block` too).

The sampler itself is replaced by a recorder (its output: all EOS), so these tests compile
nothing; what they check is the SamplingConfig that reaches sampler_programs.make_generate_fn."""

import dataclasses
import types

import numpy as np
import pytest

from dlmjax import evaluate
from dlmjax import generate
from dlmjax import model as model_lib
from dlmjax.diffusion import sampler_programs, sampling_config
from dlmjax.rl import evaluation as rl_evaluation
from dlmjax.rl import rollout as rollout_lib
from tests import evaluate_test
from tests.conftest import tiny_test_config

# Every field away from its default, in two sets (threshold and factor exclude each other).
THRESHOLD = dict(
  gen_length=8,
  steps=4,
  block_length=4,
  temperature=0.5,
  top_p=0.9,
  cfg_scale=0.5,
  remasking='margin',
  threshold=0.7,
  cache='truncate',
  cache_refresh=0,
  stop_at_eos=True,
  alg_temp=0.3,
  factor=0.0,
  entropy_threshold=0.0,
  edit_threshold=0.0,
  edit_steps=16,
  block_add_threshold=0.0,
  schedule='dream',
  eps=0.01,
  mask_in_softmax=True,
)
FACTOR = {
  **THRESHOLD,
  'remasking': 'maskgit_plus',
  'threshold': 0.0,
  'factor': 1.5,
  'entropy_threshold': 0.3,  # dParallel's rule on top of the factor rule's commits
  'edit_threshold': 0.4,  # LLaDA2.1's edits of committed tokens, two edit-only steps a block
  'edit_steps': 2,
  'cache': 'dual',
  'cache_refresh': 2,
  'schedule': 'linear',
}
# Block decoding of a block-causal model (the RL run's model is one): SDAR's block of 4 and
# threshold, the block K/V cache, stop at EOS.
BLOCK = {**THRESHOLD, 'block_length': 4, 'remasking': 'low_confidence', 'cache': 'block'}
# d3LLM's multi-block decoding: its own loop, uncached, committing by entropy.
MULTI = {
  **THRESHOLD,
  'block_add_threshold': 0.1,
  'entropy_threshold': 0.5,
  'threshold': 0.0,
  'alg_temp': 0.0,
  'cache': 'none',
  'stop_at_eos': False,
}
SETTINGS = [THRESHOLD, FACTOR, BLOCK, MULTI]


def test_the_settings_cover_every_field():
  defaults = sampling_config.SamplingConfig()
  assert set(THRESHOLD) == set(sampling_config.FIELDS)
  for name in sampling_config.FIELDS:
    assert any(s[name] != getattr(defaults, name) for s in SETTINGS), name


@pytest.fixture
def recorded(monkeypatch):
  """The SamplingConfigs make_generate_fn was built with, in order."""
  seen = []

  def fake_make_generate_fn(model_config, sampling, *, eos_id, **kwargs):
    del model_config, kwargs
    seen.append(sampling)
    return lambda params, prompt_BP, lengths_B, key: np.full(
      (prompt_BP.shape[0], prompt_BP.shape[1] + sampling.gen_length), eos_id, np.int32
    )

  monkeypatch.setattr(sampler_programs, 'make_generate_fn', fake_make_generate_fn)
  return seen


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  return str(evaluate_test.make_word_run(tmp_path_factory.mktemp('entry') / 'run', seq_len=48))


def _flags(settings):
  argv = []
  for name, value in settings.items():
    if isinstance(value, bool):
      argv += [sampling_config.FLAGS[name]] if value else []
    else:
      argv += [sampling_config.FLAGS[name], str(value)]
  return argv


@pytest.mark.parametrize('settings', SETTINGS)
def test_generate(run_dir, recorded, settings, capsys):
  argv = ['--checkpoint-path', run_dir, '--prompt', 'w1 w2', *_flags(settings)]
  assert generate.main(argv) == 0, capsys.readouterr().err
  assert recorded == [sampling_config.SamplingConfig(**settings)]


@pytest.mark.parametrize('settings', SETTINGS)
def test_evaluate_tasks(run_dir, recorded, settings, capsys):
  argv = ['--checkpoint-path', run_dir, 'tasks', '--tasks', 'arithmetic', '--num', '2']
  assert evaluate.main(argv + _flags(settings)) == 0, capsys.readouterr().err
  assert recorded == [sampling_config.SamplingConfig(**settings)]


@pytest.mark.parametrize('settings', SETTINGS)
def test_lm_eval_generate_until(run_dir, recorded, settings):
  lm_eval_adapter = pytest.importorskip('dlmjax.lm_eval_adapter')  # the `eval` extra
  # model_args arrive as strings; cfg is the likelihood's and the sampler's cfg_scale.
  args = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}
  args['cfg'] = args.pop('cfg_scale')
  model = lm_eval_adapter.DlmjaxLM(checkpoint_path=run_dir, batch_size='2', **args)
  request = types.SimpleNamespace(args=('w1 w2', {'until': ['w9']}))
  assert model.generate_until([request]) == ['']
  assert recorded == [sampling_config.SamplingConfig(**settings)]


def _rl_config(settings):
  block_causal = {'model.attention_mask': 'block_causal', 'model.block_size': 4}
  return tiny_test_config(
    **{
      **(block_causal if settings['cache'] in ('truncate', 'block') else {}),
      'stage': 'rl',
      'rl.kl_beta': 0.0,
      'rl.max_prompt_tokens': 16,
      **{f'sampler.{k}': v for k, v in settings.items()},
    }
  )


@pytest.mark.parametrize('settings', SETTINGS)
def test_rl_rollouts_and_held_out_evaluation(recorded, settings):
  config = _rl_config(settings)
  setup = types.SimpleNamespace(model_config=model_lib.ModelConfig.from_config(config), mesh=None)
  prompts = types.SimpleNamespace(tokenizer=None)
  rollout_lib.make_batches(config, setup, prompts)
  rl_evaluation.HeldOutReward(config, setup, prompts)
  expected = sampling_config.SamplingConfig(**settings)
  # Held-out problems are decoded greedily, with every other setting the rollouts'.
  assert recorded == [expected, dataclasses.replace(expected, temperature=0.0)]
