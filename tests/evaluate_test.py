"""python -m dlmjax.evaluate on a tiny run: likelihood rows, multiple choice, tasks, bad input."""

import json

import jax
import numpy as np
import pytest

from dlmjax import evaluate
from dlmjax import model as model_lib
from dlmjax.checkpoint import params_checkpoint
from dlmjax.diffusion import sampling_config
from dlmjax.tasks.code import InfillExample
from tests.checkpoint import tiny_run

WORDS = ['<pad>', '<unk>', '<eos>', '<mask>'] + [f'w{i}' for i in range(200)]


def write_word_tokenizer(directory):
  """A whitespace word-level tokenizer.json (pad 0, unk 1, eos 2, mask 3) in `directory`."""
  import tokenizers  # pylint: disable=import-outside-toplevel

  tok = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token='<unk>')
  )
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(directory / 'tokenizer.json'))


def make_word_run(directory, seq_len):
  """A params-only tiny run (random init, jitted: eager init costs seconds) with a word-level
  tokenizer.json beside its config."""
  config = tiny_run.tiny_config(**{'model.seq_len': seq_len})
  cfg = model_lib.ModelConfig.from_config(config)
  params = jax.jit(lambda key: model_lib.init_params(cfg, key))(jax.random.key(0))
  params_checkpoint.save_params_checkpoint(str(directory), config, params)
  write_word_tokenizer(directory)
  return directory


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  return make_word_run(tmp_path_factory.mktemp('evaluate') / 'run', seq_len=48)


def _write(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


def test_likelihood_rows_and_multiple_choice(run_dir, tmp_path, capsys):
  data = _write(
    tmp_path / 'rows.jsonl',
    [
      {'context': 'w1 w2 w3', 'continuation': ' w4 w5'},
      {'context': 'w7 w8', 'continuation': ' w9'},
      {'context': 'w7 w8', 'choices': [' w9', ' w4 w5', ' w10'], 'label': 1},
    ],
  )
  out = tmp_path / 'out.jsonl'
  code = evaluate.main(
    [
      '--checkpoint-path',
      str(run_dir),
      '--output',
      str(out),
      '--batch-size',
      '4',
      'likelihood',
      '--data',
      data,
      '--mc-num',
      '4',
      '--mc-batch',
      '2',
    ]
  )
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['tokens'] for r in rows[:2]] == [2, 1]
  lls = rows[2]['log_likelihoods']
  assert len(lls) == 3 and all(np.isfinite(lls)) and all(x < 0 for x in lls)
  # A row's estimate depends only on its tokens and the seed: the choice ' w9' scores as row 2.
  assert lls[0] == pytest.approx(rows[1]['log_likelihood'], rel=1e-5)
  assert rows[2]['prediction'] == int(np.argmax(lls))
  assert summary['accuracy'] == float(rows[2]['prediction'] == 1)
  assert summary['log_likelihood_sum'] == pytest.approx(
    rows[0]['log_likelihood'] + rows[1]['log_likelihood']
  )
  assert summary['nll_per_token'] == pytest.approx(-summary['log_likelihood_sum'] / 3)


def test_tasks_mode_decodes_and_scores(run_dir, capsys):
  code = evaluate.main(
    [
      '--checkpoint-path',
      str(run_dir),
      '--batch-size',
      '2',
      'tasks',
      '--tasks',
      'arithmetic',
      '--num',
      '3',
      '--gen-length',
      '8',
      '--steps',
      '4',
      '--block-length',
      '4',
    ]
  )
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary['arithmetic']['examples'] == 3
  assert 0.0 <= summary['arithmetic']['accuracy'] <= 1.0


def test_tasks_mode_averages_over_samples():
  """samples=2 decodes each problem twice (the prompts repeated in order) and averages all."""
  from dlmjax import tasks  # pylint: disable=import-outside-toplevel

  task = tasks.get_task('arithmetic')
  examples = task.examples('test', 3, 0)

  class TwoDraws:  # the first draw of each problem right, the second garbage
    def generate(self, prompts):
      assert prompts == [e.prompt for e in examples] * 2
      return [e.response for e in examples] + ['garbage'] * 3

  _, summary = evaluate.tasks_mode(TwoDraws(), ['arithmetic'], num=3, seed=0, samples=2)
  rewards = [task.reward(e, e.response) for e in examples] + [
    task.reward(examples[0], 'garbage')
  ] * 3
  assert summary['arithmetic'] == dict(
    examples=3, samples=2, accuracy=0.5, mean_reward=pytest.approx(np.mean(rewards))
  )
  assert rewards[0] == task.max_reward and rewards[-1] == 0.0
  with pytest.raises(ValueError, match='samples=0'):
    evaluate.tasks_mode(TwoDraws(), ['arithmetic'], num=3, seed=0, samples=0)


@pytest.mark.parametrize(
  'row,message',
  [
    ({'continuation': 'x'}, 'needs a string "context"'),
    ({'context': 'a'}, 'needs a string "continuation"'),
    ({'context': 'a', 'choices': ['x', 'y'], 'label': 2}, '"label" must be the index'),
    ({'context': 'a', 'choices': ['x']}, 'at least 2 strings'),
  ],
)
def test_bad_rows_are_one_line_errors(tmp_path, capsys, row, message):
  data = _write(tmp_path / 'bad.jsonl', [row])
  code = evaluate.main(['--checkpoint-path', str(tmp_path), 'likelihood', '--data', data])
  assert code == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and message in err and 'bad.jsonl:1' in err


def test_bad_settings_are_one_line_errors(run_dir, tmp_path, capsys):
  data = _write(tmp_path / 'rows.jsonl', [{'context': 'w1', 'continuation': ' w2'}])
  assert (
    evaluate.main(
      [
        '--checkpoint-path',
        str(run_dir),
        'likelihood',
        '--data',
        data,
        '--mc-num',
        '10',
        '--mc-batch',
        '4',
      ]
    )
    == 2
  )
  assert 'must divide mc_num' in capsys.readouterr().err
  assert (
    evaluate.main(['--checkpoint-path', str(tmp_path / 'nope'), 'likelihood', '--data', data]) == 2
  )
  assert 'does not exist' in capsys.readouterr().err


def test_file_tasks_report_the_peers_metrics(tmp_path):
  """GSM8K, MATH500 and HumanEval test files through tasks_mode: accuracy, reward and the
  peers' extraction (d1's eval, lm-eval's) on completions whose verdicts differ by design."""
  from tests.tasks import code_exec_test  # pylint: disable=import-outside-toplevel

  gsm = _write(tmp_path / 'gsm.jsonl', [{'question': 'q?', 'answer': 'w\n#### 1,200'}])
  math = _write(tmp_path / 'math.jsonl', [{'problem': 'p?', 'solution': '\\boxed{\\frac{1}{2}}'}])
  human = _write(tmp_path / 'he.jsonl', [code_exec_test.HUMANEVAL])
  completions = {
    'gsm8k': [
      '<reasoning>\nw\n</reasoning>\n<answer>\n1200\n</answer>\n',  # every metric
      'so \\boxed{1200}, I said 1199',  # d1's eval (the box) only
      '<answer>\n1,200\n</answer> is $1,200.',  # lm-eval's only (d1's eval reads 200)
    ],
    'math500': [
      '<answer>\\boxed{\\frac{2}{4}}</answer>',  # the CAS and math-verify; not d1's strings
      '\\boxed{\\dfrac12}',  # all three
      '\\boxed{2}',  # none
    ],
    'humaneval': ['    return a + b\n', '    return a - b\n', 'def add(:'],
  }

  class Fixed:
    def __init__(self):
      self.name = None

    def generate(self, prompts):
      return completions[self.name][: len(prompts)] * (3 // len(prompts))

  model = Fixed()
  summaries = {}
  for name, path in [('gsm8k', gsm), ('math500', math), ('humaneval', human)]:
    model.name = name
    tasks_entry = [(name, path)]
    _, summary = evaluate.tasks_mode(model, tasks_entry, num=0, seed=0, samples=3)
    summaries[name] = summary[name]
  # samples=3 repeats the one problem: each completion above is one of the three draws.
  assert summaries['gsm8k']['accuracy'] == pytest.approx(1 / 3)
  assert summaries['gsm8k']['d1_eval'] == pytest.approx(2 / 3)
  assert summaries['gsm8k']['lm_eval_flexible'] == pytest.approx(2 / 3)
  assert summaries['math500']['accuracy'] == pytest.approx(2 / 3)
  assert summaries['math500']['d1_eval'] == pytest.approx(1 / 3)
  assert summaries['math500']['lm_eval_math_verify'] == pytest.approx(2 / 3)
  assert summaries['humaneval']['accuracy'] == pytest.approx(1 / 3)  # pass@1
  assert summaries['humaneval']['mean_reward'] == pytest.approx((1 + 1 / 3) / 3)
  assert evaluate.parse_task_list('countdown3, math500=a.jsonl') == [
    ('countdown3', ''),
    ('math500', 'a.jsonl'),
  ]
  with pytest.raises(ValueError, match='--tasks math500=PATH'):
    evaluate.tasks_mode(model, ['math500'], num=1, seed=0)


def test_eval_model_fills_the_hole_between_prefix_and_suffix(run_dir, monkeypatch):
  """evaluate tasks' infilling (tests/evaluate_infill_test.py): the canvas is prefix, the hole
  of MASKs, suffix; the middle comes back without MASK, EOS or padding."""
  sampling = sampling_config.SamplingConfig(gen_length=4, steps=2, block_length=4)
  model = evaluate.EvalModel(str(run_dir), batch_size=2, sampling=sampling)
  mask = model.mask_id
  examples = [
    InfillExample(prompt='w1 w2', response='w3 w4', answer='a', prefix='w1 w2', suffix='w5'),
    InfillExample(prompt='w7', response='w8', answer='b', prefix='w7', suffix='w9 w10'),
  ]
  seen, real = [], model.pretrained.infill_tokens
  monkeypatch.setattr(
    model.pretrained, 'infill_tokens', lambda ids, **kw: seen.append(ids) or real(ids, **kw)
  )
  ids = lambda text: model.tokenizer.encode(text)  # noqa: E731
  # 0: the canonical middle's token count; both canvases 5 wide (one compilation)
  for hole, lengths in ((0, (2, 1)), (2, (2, 2))):
    middles = model.infill(examples, hole)
    assert seen[-1] == [
      ids(e.prefix) + [mask] * n + ids(e.suffix) for e, n in zip(examples, lengths)
    ]
    for middle, n in zip(middles, lengths):
      words = middle.split()
      assert len(words) <= n and all(w.startswith('w') for w in words)  # no MASK, EOS or pad
