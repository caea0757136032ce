"""Stage rl end to end on a tiny random model: rollouts, d1 and ESPO steps, logged metrics."""

import json
import os

import jax
import pytest

from dlmjax import config as config_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.train import loop
from dlmjax.train.stages import rl as rl_stage
from dlmjax.train import state as state_lib
from dlmjax.parallel import mesh as mesh_lib
from tests import stage_configs
from tests.conftest import tiny_test_config


@pytest.fixture(scope='module')
def init_dir(tmp_path_factory):
  """A random tiny model saved as a run directory, standing in for an SFT checkpoint."""
  out = str(tmp_path_factory.mktemp('init'))
  c = tiny_test_config(**{'model.seq_len': 64, 'output_dir': out})
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
  params = setup.init_state(0)['params']
  params_checkpoint.save_params_checkpoint(out, c, jax.device_get(params))
  return out


@pytest.mark.slow  # ~90 s each on the shared 2-core machine: compiles sampler, scorer, step
@pytest.mark.parametrize('objective', ['d1', 'espo', 'spg', 'wd1pp'])
def test_rl_runs_and_logs(tmp_path, init_dir, objective):
  # ESPO also holds its reference in host memory, in bfloat16; SPG has no reference (no KL).
  # d1 also evaluates held-out reward (eval.every) at steps 1 and 2, on 16 test problems, and
  # runs over a block-causal model (blocks of 4, SDAR's): rollouts and held-out decoding by block
  # decoding with the block K/V cache and stop at EOS, so _check_held_out_against_inference also
  # shows the cache exact (inference decodes without one). ESPO and SPG keep the bidirectional
  # model and the uncached sampler.
  block_causal = {
    'model.attention_mask': 'block_causal',
    'model.block_size': 4,
    'sampler.cache': 'block',
    'sampler.block_length': 4,
    'sampler.steps': 8,
    'sampler.stop_at_eos': True,
  }
  extra = {
    'd1': {'eval.every': 1, 'eval.batches': 1, **block_causal},
    'espo': {'rl.reference_on_host': True, 'rl.reference_dtype': 'bfloat16'},
    'spg': {'rl.kl_beta': 0.0},
    'wd1pp': {'rl.kl_beta': 0.0},  # 2 steps: G x 2 step predictions scored per prompt
  }[objective]
  c = stage_configs.rl_config(tmp_path, init_dir, **{'rl.objective': objective, **extra})
  last = loop.train(c)
  assert last['step'] == 2
  for key in ('loss', 'kl', 'clip_fraction', 'reward_mean', 'reward_std', 'completion_length'):
    assert key in last and last[key] == last[key]
  rows = [json.loads(line) for line in open(os.path.join(c.output_dir, 'metrics.jsonl'))]
  rollout = [r for r in rows if 'generate_s' in r]
  assert len(rollout) == 1 and rollout[0]['score_s'] > 0 and rollout[0]['reward_failures'] == 0
  assert ('rollout_step_reward_mean' in rollout[0]) == (objective == 'wd1pp')
  # mu = 2 updates on one rollout: the first has ratio 1 (old = current params), so no clipping.
  first = [r for r in rows if r.get('step') == 1 and 'loss' in r][0]
  assert first['clip_fraction'] == 0.0
  if objective == 'd1':  # policy = reference at step 1 (ESPO's bf16 reference differs by rounding)
    assert first['kl'] == pytest.approx(0.0, abs=1e-6)
  assert first['kl'] >= 0.0
  val = [r for r in rows if 'val_reward' in r]
  if objective != 'd1':
    assert not val
    return
  assert [r['step'] for r in val] == [1, 2]
  assert all(r['val_examples'] == 16 and r['val_reward_failures'] == 0 for r in val)
  _check_held_out_against_inference(c, val[-1])


def _check_held_out_against_inference(c, row):
  """The final checkpoint's held-out completions, decoded by the rollout source on the run's
  mesh, are token for token those of dlmjax.inference (its own batching and padding, one device)
  with the same sampler at temperature 0; the logged last row is their reward."""
  from dlmjax import inference  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import advantages  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import evaluation as rl_evaluation  # pylint: disable=import-outside-toplevel

  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
  prompts = rl_stage.make_prompts(c)
  held_out = rl_evaluation.HeldOutReward(c, setup, prompts)
  on_mesh = inference.load_pretrained(c.output_dir, mesh=setup.mesh)
  examples, texts = held_out.completions(on_mesh.params, 16, config_lib.EVAL_SEED)
  prompt_ids = prompts.encode('test', 16, config_lib.EVAL_SEED).token_ids
  rows = inference.load_pretrained(c.output_dir).generate_tokens(
    prompt_ids,
    batch_size=4,
    gen_length=c.sampler.gen_length,
    steps=c.sampler.steps,
    block_length=c.sampler.block_length,
    temperature=0.0,
  )
  assert texts == [prompts.tokenizer.decode(r) for r in rows]
  # The comparison is not vacuous: the problems differ (whatever the tiny model decodes them to).
  assert len({tuple(p) for p in prompt_ids}) > 1
  rewards, _ = advantages.score(prompts.task.reward, examples, texts)
  assert row['val_reward'] == pytest.approx(float(rewards.mean()), abs=1e-6)
  correct = [prompts.task.is_correct(e, t) for e, t in zip(examples, texts)]
  assert row['val_accuracy'] == pytest.approx(float(sum(correct)) / len(correct))


@pytest.mark.parametrize(
  'overrides, match',
  [
    ({'rl.group_size': 1}, 'at least 2'),
    ({'rl.group_size': 3}, 'does not divide'),  # 16 rows
    ({'rl.num_prompts': 0}, 'must be >= 1'),
    ({'sampler.gen_length': 60}, 'exceed model.seq_len'),
    ({'sampler.block_length': 5}, 'block_length'),
    ({'init_from': ''}, 'init_from'),
    ({'rl.objective': 'spg'}, 'no KL term'),  # kl_beta 0.04 by default
    ({'rl.objective': 'wd1'}, 'no KL term'),
    ({'rl.objective': 'spg', 'rl.kl_beta': 0.0, 'rl.ref_sync_every': 4}, 'ref_sync_every=0'),
    ({'rl.ref_sync_every': 4, 'rl.reference_on_host': True}, 'reference_on_host=False'),
    ({'rl.ref_sync_alpha': 0.0}, 'ref_sync_alpha'),
    ({'rl.objective': 'spg', 'rl.kl_beta': 0.0, 'rl.spg_eubo_beta': 0.5}, 'spg_eubo_beta'),
    ({'rl.objective': 'trace'}, 'attention_mask=block_causal'),  # bidirectional here
  ],
)
def test_bad_rl_configs_name_the_fix(tmp_path, overrides, match):
  c = stage_configs.rl_config(tmp_path, 'unused', **overrides)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)


def test_prompts_too_long_is_a_clear_error(tmp_path, init_dir):
  c = stage_configs.rl_config(tmp_path, init_dir, **{'rl.max_prompt_tokens': 2})
  with pytest.raises(ValueError, match='max_prompt_tokens'):
    rl_stage.make_prompts(c)


def test_valid_split_is_train_problems_outside_the_rl_prompts(tmp_path, init_dir):
  """rl.eval_split=valid: train-split problems, none of them an RL prompt, even when the eval
  seed draws the same sequence as the RL prompts (seed 0 both)."""
  c = stage_configs.rl_config(tmp_path, init_dir, **{'rl.task': 'arithmetic', 'seed': 0})
  prompts = rl_stage.make_prompts(c)
  held_out = prompts.held_out('valid', 24, 0)
  examples = held_out.examples
  assert len(examples) == len(held_out.token_ids) == 24
  assert not {e.prompt for e in examples} & {e.prompt for e in prompts.training.examples}
  test = {e.answer for e in prompts.task.examples('test', 200, 0)}
  assert not test & {e.answer for e in examples}  # the split is by answer: no test answer
  with pytest.raises(ValueError, match='held-out split'):
    prompts.held_out('dev', 4, 0)
