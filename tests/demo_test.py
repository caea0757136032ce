"""python -m dlmjax.demo and configs/demo.py: the stage chain, the table's aggregation, and bad
input (no training)."""

import importlib.util
import json
import os

import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import demo
from dlmjax import tasks as tasks_lib
from dlmjax.data import builtin, chat
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.demo import distill_stage, runs


def _recipe():
  """configs/demo.py as a module: the recipe's values."""
  spec = importlib.util.spec_from_file_location(
    'demo_recipe', os.path.join(demo.configs_dir(), 'demo.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rows(rng, seeds=(0, 1, 2)):
  return [
    dict(
      seed=s,
      stage=stage,
      steps=int(rng.integers(1, 100)),
      loss=float(rng.random()),
      accuracy=float(rng.random()),
      mean_reward=float(rng.random()),
      verify=True,
    )
    for s in seeds
    for stage in demo.STAGES
  ]


def test_aggregate_matches_numpy():
  rng = np.random.default_rng(0)
  rows = _rows(rng)
  rows[4]['verify'] = False  # seed 1, sft
  summary = demo.aggregate(rows)
  assert summary['seeds'] == [0, 1, 2]
  for stage in demo.STAGES:
    for metric in ('steps', 'loss', 'accuracy', 'mean_reward'):
      values = np.array([r[metric] for r in rows if r['stage'] == stage], np.float64)
      got = summary['stages'][stage][metric]
      np.testing.assert_allclose(got['mean'], values.mean(), rtol=1e-12)
      np.testing.assert_allclose(
        got['std'], np.sqrt(((values - values.mean()) ** 2).sum() / 2), rtol=1e-12
      )
  assert not summary['stages']['sft']['verify'] and summary['stages']['rl']['verify']
  for metric in ('accuracy', 'mean_reward'):
    sft = np.array([r[metric] for r in rows if r['stage'] == 'sft'])
    rl = np.array([r[metric] for r in rows if r['stage'] == 'rl'])
    g = summary['rl_gain'][metric]
    np.testing.assert_allclose(g['gain'], rl.mean() - sft.mean(), rtol=1e-12)
    np.testing.assert_allclose(g['paired'], rl - sft, rtol=1e-12)
    spread = max(sft.std(ddof=1), rl.std(ddof=1))
    np.testing.assert_allclose(g['spread'], spread, rtol=1e-12)
    assert g['beats_noise'] == (rl.mean() - sft.mean() > spread)
    d = rl - sft
    np.testing.assert_allclose(g['paired_t'], d.mean() / (d.std(ddof=1) / np.sqrt(3)), rtol=1e-12)


def test_gain_against_noise_verdict_and_table():
  rows = []
  for seed, (sft, rl) in enumerate([(0.40, 0.60), (0.42, 0.63), (0.38, 0.58)]):
    for stage, value in (('pretrain', 0.1), ('sft', sft), ('rl', rl)):
      rows.append(
        dict(
          seed=seed,
          stage=stage,
          steps=10,
          loss=1.0,
          accuracy=value / 2,
          mean_reward=value,
          verify=True,
        )
      )
  rows[2]['seed_wall_s'] = 600.0  # seed 0's rl row carries the seed's wall time
  summary = demo.aggregate(rows)
  g = summary['rl_gain']['mean_reward']
  assert g['beats_noise'] and g['gain'] == pytest.approx(0.2033333, abs=1e-6)
  assert g['spread'] == pytest.approx(np.std([0.60, 0.63, 0.58], ddof=1))
  table = demo.format_table(rows, summary)
  assert table.count('PASS') == 12  # 9 rows + 3 means
  assert '0.603+-0.025' in table and '0.302+-0.013' in table  # rl: mean reward, accuracy
  assert 'beats the noise' in table and 'NOT' not in table
  assert 'wall time (train + evaluate + verify): seed 0 10.0 min' in table
  # paired gains 0.20, 0.21, 0.20: mean 0.2033, std 0.0058, t = 0.2033 / (0.0058 / sqrt 3)
  assert 'paired per seed: +0.203 +- 0.006, t 61.0 over 3 seeds' in table
  # A gain within the spread is reported as such.
  for r in rows:
    if r['stage'] == 'rl':
      r['mean_reward'] = 0.40 + 0.2 * r['seed']
  flat = demo.aggregate(rows)['rl_gain']['mean_reward']
  assert not flat['beats_noise']
  assert 'does NOT beat' in demo.format_table(rows, demo.aggregate(rows))


def test_one_seed_has_zero_spread_and_missing_rows_are_named():
  rows = _rows(np.random.default_rng(1), seeds=(5,))
  assert demo.aggregate(rows)['stages']['rl']['accuracy']['std'] == 0.0
  with pytest.raises(ValueError, match=r'stage rl has no result for seeds \[6\]'):
    demo.aggregate(rows + [dict(rows[0], seed=6), dict(rows[1], seed=6)])
  with pytest.raises(ValueError, match='no result rows'):
    demo.aggregate([])


@pytest.mark.parametrize('text', ['', ' ', '0,,1', 'a,b', '1,1', '-1'])
def test_bad_seeds(text):
  with pytest.raises(ValueError, match='--seeds'):
    demo.parse_seeds(text)
  assert demo.parse_seeds(' 2, 0 ,1') == [2, 0, 1]


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
  assert demo.main(['--seeds', '', '--output-dir', str(tmp_path / 'out')]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: --seeds') and 'e.g. --seeds 0,1,2' in err
  assert not (tmp_path / 'out').exists()  # nothing ran
  assert demo.main(['--task', 'chess', '--output-dir', str(tmp_path / 'out')]) == 2
  assert 'choose one of' in capsys.readouterr().err


def test_stage_configs_chain_and_validate(tmp_path):
  configs = demo.stage_configs(7, str(tmp_path / 'seed7'), 'sudoku4')
  recipe = _recipe().recipe('d1', 'sudoku4')
  assert list(configs) == list(demo.STAGES) == list(_recipe().STAGES)
  assert configs['sft'].init_from == configs['pretrain'].output_dir
  assert configs['rl'].init_from == configs['sft'].output_dir
  assert configs['rl'].rl.task == 'sudoku4'
  for stage, c in configs.items():
    assert c.seed == 7 and c.model.seq_len == sum(_recipe().TASK_CANVAS['sudoku4']) == 80
    for key, value in recipe[stage].items():
      node = c
      for part in key.split('.'):
        node = node[part]
      assert node == value, key
  config_lib.validate(configs['rl'])  # the recipe is a valid RL config
  # The demo's documented results are on the tiny preset's shape, which configs/tiny.py narrows.
  shape = ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim', 'ffn_dim')
  tiny = config_lib.PRESETS['tiny']
  assert {k: configs['pretrain'].model[k] for k in shape} == {k: tiny[k] for k in shape}
  r = configs['rl'].rl
  assert r.max_prompt_tokens + configs['rl'].sampler.gen_length <= configs['rl'].model.seq_len
  with pytest.raises(config_lib.ConfigError, match='rl.nope is not a config key'):
    config_lib.apply_overrides(configs['rl'], {'rl.nope': 1})


def test_other_objectives_share_pretraining_and_sft(tmp_path):
  d1 = demo.stage_configs(3, str(tmp_path), 'sudoku4')
  spg = demo.stage_configs(3, str(tmp_path), 'sudoku4', 'spg')
  assert spg['sft'].output_dir == d1['sft'].output_dir  # the same SFT run feeds both RL runs
  assert spg['rl'].output_dir == str(tmp_path / 'rl_spg') != d1['rl'].output_dir
  assert spg['rl'].rl.objective == 'spg' and spg['rl'].rl.kl_beta == 0.0
  config_lib.validate(spg['rl'])
  recipe = _recipe()
  assert recipe.recipe('d1') == {
    stage: {**recipe.canvas_overrides('sudoku4')[stage], **keys}
    for stage, keys in recipe.STAGE_RECIPE.items()
  }
  with pytest.raises(ValueError, match='--objective'):
    recipe.recipe('ppo')
  with pytest.raises(ValueError, match='--objective'):
    demo.stage_configs(3, str(tmp_path), 'sudoku4', 'ppo')


@pytest.mark.parametrize('task', sorted(_recipe().TASK_CANVAS))
def test_every_task_gets_its_own_canvas(tmp_path, task):
  prompt, gen = _recipe().TASK_CANVAS[task]
  configs = demo.stage_configs(1, str(tmp_path), task)
  assert {c.model.seq_len for c in configs.values()} == {prompt + gen}
  r, s = configs['rl'].rl, configs['rl'].sampler
  assert (r.max_prompt_tokens, s.gen_length, s.steps) == (prompt, gen, gen // 2)
  config_lib.validate(configs['rl'])
  assert demo.eval_sampling(configs['rl']).gen_length == gen
  # The widths hold the task's prompts (plain template) and answers + EOS on the tiny tokenizer.
  cache = os.environ.get('DLMJAX_CACHE_DIR') or str(tmp_path / 'cache')
  tok = tokenizer_lib.load_tokenizer(builtin.ensure_builtin_corpus(cache).tokenizer_path)
  examples = tasks_lib.get_task(task).examples('train', 300, 0)
  assert max(len(tok.encode(chat.prompt_text('plain', e.prompt))) for e in examples) <= prompt
  assert max(len(tok.encode(e.response)) + 1 for e in examples) <= gen


def test_a_task_without_a_canvas_is_a_clear_error():
  with pytest.raises(ValueError, match='sized for'):
    _recipe().recipe('d1', 'gsm8k')
  with pytest.raises(ValueError, match='sized for'):
    demo.stage_configs(0, '/tmp/unused', 'gsm8k')


def test_sft_set_is_train_split_only(tmp_path):
  path = demo.write_sft_set(str(tmp_path / 'sft.jsonl'), 'sudoku4', num=50)
  rows = [json.loads(line) for line in open(path)]
  assert len(rows) == 50 and all(set(r) == {'prompt', 'response'} for r in rows)
  test_answers = {e.answer for e in tasks_lib.get_task('sudoku4').examples('test', 40, 0)}
  train = tasks_lib.get_task('sudoku4').examples('train', 50, 0)
  assert [r['response'] for r in rows] == [e.response for e in train]
  assert not test_answers & {e.answer for e in train}


def test_final_loss_skips_rollout_rows(tmp_path):
  lines = [dict(step=2, loss=0.5), dict(step=3, rollout=1, generate_s=1.0), dict(step=4, loss=0.25)]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in lines))
  assert demo.final_loss(str(tmp_path)) == (4, 0.25)
  assert demo.final_loss(str(tmp_path), step=2) == (2, 0.5)


def test_best_checkpoint_is_the_best_validation_reward(tmp_path):
  lines = [dict(step=1, loss=0.1)] + [
    dict(step=s, val_reward=v) for s, v in ((10, 0.5), (20, 0.9), (30, 0.4), (40, 0.9), (50, 0.2))
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in lines))
  for step in (10, 20, 30, 50):
    (tmp_path / 'checkpoints' / str(step)).mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='step 40, but .* was not kept'):
    demo.best_checkpoint(str(tmp_path))  # 20 and 40 tie: the later one, not kept
  (tmp_path / 'checkpoints' / '40').mkdir()
  assert demo.best_checkpoint(str(tmp_path)) == str(tmp_path / 'checkpoints' / '40')
  (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=1, loss=0.1)) + '\n')
  assert demo.best_checkpoint(str(tmp_path)) == str(tmp_path)  # no validation rows: the run


def test_rl_stage_keeps_every_checkpoint_it_scores():
  rl = _recipe().recipe('d1', 'arithmetic')['rl']
  assert rl['checkpoint.every'] == rl['eval.every'] and rl['rl.eval_split'] == 'valid'
  assert rl['checkpoint.keep'] * rl['checkpoint.every'] >= rl['train.steps']


def test_one_stage_alone_from_the_config_file(tmp_path):
  """configs/demo.py:STAGE,TASK is the demo's stage config without the chain's paths."""
  chained = demo.stage_configs(0, str(tmp_path), 'arithmetic', 'espo')['rl']
  alone = demo.base_config(
    os.path.join(demo.configs_dir(), 'rl.py'), _recipe().recipe('espo', 'arithmetic')['rl']
  )
  from_file = _recipe().get_config('rl,arithmetic,espo')
  assert from_file.rl.task == chained.rl.task == 'arithmetic'
  for key in ('model.seq_len', 'rl.objective', 'sampler.gen_length', 'train.lr', 'eval.every'):
    assert config_lib.get_key(from_file, key) == config_lib.get_key(chained, key), key
  assert from_file.rl.objective == alone.rl.objective == 'espo'
  with pytest.raises(ValueError, match='the stage is one of'):
    _recipe().get_config('eval')


def test_an_early_stop_names_the_step_its_checkpoint_holds(tmp_path, monkeypatch):
  """The stop message names the checkpointed step (what a resume starts from), not the last
  logged row's."""
  monkeypatch.setattr(runs.loop, 'train', lambda config: None)
  monkeypatch.setattr(runs.run_dir_lib, 'resolve_step_dir', lambda path: (path, path, 6))
  monkeypatch.setattr(runs, 'final_loss', lambda run_dir, step=None: (5, 1.0))
  with pytest.raises(InterruptedError, match=r'pretrain stopped with its checkpoint at step 6 of'):
    demo.run_seed(0, str(tmp_path), 'sudoku4')


def test_distill_stage_starts_from_the_sft_teacher_on_its_rows(tmp_path):
  """--distill's stage: the SFT run is the frozen teacher (init_from), its rows the data, the eval
  sampler's block the distilled block; an unknown objective is one error line."""
  configs = demo.stage_configs(0, str(tmp_path), 'arithmetic')
  sampling = demo.eval_sampling(configs['rl'])
  c = demo.distill_config(configs['sft'], 'trajectory', str(tmp_path), sampling)
  assert c.init_from == configs['sft'].output_dir
  assert c.output_dir == str(tmp_path / 'distill_trajectory')
  assert c.sft.teacher_file == str(tmp_path / 'teacher_rows.npz') and not c.sft.train_file
  assert (c.sft.objective, c.train.steps) == ('trajectory', demo.DISTILL_RECIPE['train.steps'])
  assert (c.sampler.block_length, c.sampler.gen_length) == (
    sampling.block_length,
    sampling.gen_length,
  )
  config_lib.validate(c)
  assert configs['sft'].sft.objective == 'llada'  # the SFT config is left as it was
  with pytest.raises(ValueError, match='certainty'):
    demo.distill_config(configs['sft'], 'nope', str(tmp_path), sampling)
  assert demo.main(['--distill', 'nope', '--output-dir', str(tmp_path / 'out')]) == 2
  assert not (tmp_path / 'out').exists()


def test_the_distill_stage_chains_rows_training_and_the_table(tmp_path, monkeypatch):
  """run_distill: the teacher (the seed's SFT run) writes rows before the student trains, the
  student trains from it, and the table's rows are teacher then student, tagged with the seed."""
  calls = []
  monkeypatch.setattr(
    distill_stage,
    'write_teacher_rows',
    lambda teacher, path, *a, **k: calls.append(('rows', teacher, path, k.get('keep', 'all'))),
  )
  monkeypatch.setattr(distill_stage.loop, 'train', lambda config: calls.append(('train', config)))
  monkeypatch.setattr(distill_stage.run_dir_lib, 'resolve_step_dir', lambda path: (path, path, 400))

  def rows(models, task, settings, **kwargs):
    calls.append(('table', models, list(settings)))
    return [dict(model=m, setting=s) for m in models for s in settings]

  monkeypatch.setattr(distill_stage, 'decoding_rows', rows)
  out = demo.run_distill(2, str(tmp_path), 'arithmetic', 'certainty', log=lambda *a: None)
  sft = str(tmp_path / 'seed2' / 'sft')
  assert calls[0] == ('rows', sft, str(tmp_path / 'seed2' / 'teacher_rows.npz'), 'all')
  assert calls[1][0] == 'train' and calls[1][1].init_from == sft
  assert calls[1][1].output_dir == str(tmp_path / 'seed2' / 'distill_certainty')
  assert calls[2][1] == {'teacher': sft, 'certainty': calls[1][1].output_dir}
  assert calls[2][2][0] == 'none' and 'multi-block 0.1 entropy 0.5' in calls[2][2]
  assert [(r['model'], r['seed']) for r in out][:1] == [('teacher', 2)] and len(out) == 2 * 7
  # --keep correct: the teacher keeps only judged-correct rows, in files and a student of their own.
  calls.clear()
  demo.run_distill(2, str(tmp_path), 'arithmetic', 'certainty', log=lambda *a: None, keep='correct')
  assert calls[0][2:] == (str(tmp_path / 'seed2' / 'teacher_rows_correct.npz'), 'correct')
  assert calls[1][1].output_dir == str(tmp_path / 'seed2' / 'distill_certainty_correct')
  assert calls[1][1].sft.teacher_file == calls[0][2]
  monkeypatch.setattr(distill_stage.run_dir_lib, 'resolve_step_dir', lambda path: (path, path, 100))
  with pytest.raises(InterruptedError, match='distill stopped with its checkpoint at step 100'):
    demo.run_distill(2, str(tmp_path), 'arithmetic', 'certainty', log=lambda *a: None)


@pytest.mark.parametrize('route', ['vrpo', 'reward'])
def test_the_preference_routes_chain_from_sft_and_validate(tmp_path, route):
  configs = demo.stage_configs(2, str(tmp_path), 'arithmetic', route=route)
  plain = demo.stage_configs(2, str(tmp_path), 'arithmetic')
  assert list(configs) == list(demo.ROUTES[route])
  assert configs['sft'].output_dir == plain['sft'].output_dir  # one SFT run feeds every route
  train, held_out = demo.pair_files(str(tmp_path), 'arithmetic')
  for stage in configs:
    if stage not in ('pretrain', 'sft'):
      assert configs[stage].init_from == configs['sft'].output_dir
      config_lib.validate(configs[stage])
    if stage in ('vrpo', 'reward'):
      p = configs[stage].preference
      assert (p.train_file, p.eval_file) == (train, held_out)
  if route == 'reward':  # RL from SFT against the reward run, in a directory of its own
    assert configs['rl'].rl.reward_model == configs['reward'].output_dir
    assert configs['rl'].output_dir == str(tmp_path / 'rl_reward_model') != plain['rl'].output_dir
    assert not plain['rl'].rl.reward_model
  with pytest.raises(ValueError, match="--route 'dpo': choose one of"):
    demo.stage_configs(2, str(tmp_path), 'arithmetic', route='dpo')
  # --pairs near_miss: its own pair files and preference runs beside the default kind's
  near = demo.stage_configs(2, str(tmp_path), 'arithmetic', route=route, pairs='near_miss')
  files = demo.pair_files(str(tmp_path), 'arithmetic', 'near_miss')
  assert not set(files) & {train, held_out}
  for stage in configs:
    same = stage in ('pretrain', 'sft')
    assert (near[stage].output_dir == configs[stage].output_dir) == same
    if stage in ('vrpo', 'reward'):
      assert (near[stage].preference.train_file, near[stage].preference.eval_file) == files
  with pytest.raises(ValueError, match="--pairs 'hard': choose one of"):
    demo.stage_configs(2, str(tmp_path), 'arithmetic', route=route, pairs='hard')


def test_pair_sets_train_on_the_train_split_and_hold_out_the_test_split(tmp_path):
  demo.write_pair_sets(str(tmp_path), 'arithmetic', num=40)
  train, held_out = [
    [json.loads(line) for line in open(path)]
    for path in demo.pair_files(str(tmp_path), 'arithmetic')
  ]
  task = tasks_lib.get_task('arithmetic')
  assert [r['chosen'] for r in train] == [e.response for e in task.examples('train', 40, 0)]
  assert [r['chosen'] for r in held_out][:5] == [
    e.response for e in task.examples('test', demo.EVAL_EXAMPLES, 0)[:5]
  ]
  assert all(r['chosen'] != r['rejected'] for r in train + held_out)
  assert not {r['prompt'] for r in train} & {r['prompt'] for r in held_out}
  demo.write_pair_sets(str(tmp_path), 'arithmetic', num=40, pairs='near_miss')
  near = [
    json.loads(line) for line in open(demo.pair_files(str(tmp_path), 'arithmetic', 'near_miss')[0])
  ]
  assert [r['chosen'] for r in near] == [r['chosen'] for r in train]
  assert all(
    not task.is_correct(e, r['rejected']) for e, r in zip(task.examples('train', 40, 0), near)
  )


def test_the_vrpo_route_table_gives_vrpos_gain_and_the_reward_models_accuracy():
  rows = []
  for seed, (sft, vrpo) in enumerate([(0.40, 0.50), (0.42, 0.55)]):
    for stage, value in (('pretrain', 0.1), ('sft', sft), ('vrpo', vrpo)):
      rows.append(
        dict(seed=seed, stage=stage, steps=1, loss=1.0, accuracy=value, mean_reward=value)
      )
      rows[-1]['verify'] = True
  rows[-1]['reward_model'] = dict(
    before=dict(accuracy=0.5, margin=0.0), after=dict(accuracy=0.9, margin=1.5), pairs=64
  )
  summary = demo.aggregate(rows)
  assert summary['final_stage'] == 'vrpo'
  assert summary['rl_gain']['accuracy']['gain'] == pytest.approx(0.115)
  table = demo.format_table(rows, summary)
  assert 'VRPO gain over SFT in accuracy: +0.115' in table
  assert 'reward model (seed 1): held-out pair accuracy 0.500 before, 0.900 after' in table
