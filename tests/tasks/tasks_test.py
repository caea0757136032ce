"""Tasks: deterministic solution-disjoint splits, exact rewards, malformed outputs earn 0 safely."""

import json

import pytest

from dlmjax import tasks
from dlmjax.tasks import countdown, gsm8k, sudoku

GARBAGE = [
  '',
  '<answer>',
  '</answer><answer>',
  '<answer>' + '9' * 5000 + '</answer>',
  '<answer>2**99999999</answer>',
  '<answer>1/0</answer>',
  '<answer>__import__</answer>',
  '\x00\uffff<answer>((((</answer>',
  'x' * 10000,
]


@pytest.mark.parametrize('name', sorted(tasks.TASKS))
def test_examples_are_deterministic_disjoint_and_solved_by_their_response(name):
  task = tasks.TASKS[name]
  train, test = task.examples('train', 60, seed=1), task.examples('test', 30, seed=1)
  assert train == task.examples('train', 60, seed=1)
  assert train != task.examples('train', 60, seed=2)
  assert len({e.prompt for e in train}) == 60
  assert not {e.answer for e in train} & {e.answer for e in test}  # split by solution
  for e in train + test:
    assert tasks.split_of(f'{name}:{e.answer}') in ('train', 'test')
    assert task.reward(e, e.response) == pytest.approx(task.max_reward)
    assert task.is_correct(e, e.response)
    assert not task.is_correct(e, '')
  for completion in GARBAGE:
    value = task.reward(train[0], completion)
    assert 0.0 <= value < task.max_reward


@pytest.mark.parametrize('bad', [dict(split='valid', num=1), dict(split='train', num=-1)])
def test_bad_requests_name_the_problem(bad):
  with pytest.raises(ValueError, match='split|num'):
    tasks.TASKS['countdown3'].examples(seed=0, **bad)


def test_too_many_examples_is_a_clear_error():
  with pytest.raises(ValueError, match='distinct'):
    countdown.Countdown(3, max_number=2, max_target=4).examples('train', 100, seed=0)


def test_unknown_task():
  with pytest.raises(ValueError, match='countdown3'):
    tasks.get_task('chess')


@pytest.mark.parametrize(
  'completion, expected',
  [
    ('<answer>(16-13)*6</answer>', 1.0),
    ('think <answer>16</answer> then <answer>6*(16-13)</answer>', 1.0),  # the last one counts
    ('<answer>16-13*6</answer>', 0.1),  # right numbers, wrong value
    ('<answer>(16-13)*6*1</answer>', 0.1),  # a number not given
    ('<answer>(16-13)</answer>', 0.1),  # a number missing
    ('<answer>(16-13)*6 if 1 else 0</answer>', 0.1),  # characters outside the whitelist
    ('<answer>6/(16-16)*13</answer>', 0.1),
    ('(16-13)*6', 0.0),  # no answer tags
    ('<answer>(16-13)*6', 0.0),
  ],
)
def test_countdown_reward_matches_d1(completion, expected):
  example = tasks.Example(
    prompt=countdown.Countdown.prompt([16, 6, 13], 18), response='', answer='18'
  )
  assert tasks.TASKS['countdown3'].reward(example, completion) == expected


def test_countdown_evaluate_is_exact():
  assert countdown.evaluate('7/3*3') == 7
  assert countdown.evaluate('-(2+3)*4') == -20
  assert countdown.evaluate('7//2') == 3
  with pytest.raises(ValueError):
    countdown.evaluate('2**100')
  with pytest.raises(ValueError):
    countdown.evaluate('abs(3)')


def test_sudoku_grids_and_reward():
  grids = sudoku.all_grids()
  assert len(grids) == len(set(grids)) == 288
  for g in grids:  # rows, columns and 2x2 boxes each hold 1..4
    rows = [g[4 * r : 4 * r + 4] for r in range(4)]
    units = rows + [''.join(r[c] for r in rows) for c in range(4)]
    units += [rows[br][bc : bc + 2] + rows[br + 1][bc : bc + 2] for br in (0, 2) for bc in (0, 2)]
    assert all(sorted(u) == list('1234') for u in units)
  solution = '1243341243212134'
  puzzle = '0203340003212104'  # blanks at 0, 2, 6, 7, 8, 14
  blanks = [i for i, ch in enumerate(puzzle) if ch == '0']
  wrong = list(solution)
  wrong[blanks[0]] = '4'
  assert sudoku.compute_score(f'<answer>{"".join(wrong)}</answer>', puzzle, solution) == 5 / 6
  assert sudoku.compute_score('<answer>12 43</answer>', puzzle, solution) == 2 / 6  # padded
  assert sudoku.compute_score('<answer></answer>', puzzle, solution) == 0.0
  assert sudoku.compute_score(solution, puzzle, solution) == 0.0  # no tags
  example = tasks.TASKS['sudoku4'].examples('train', 1, seed=0)[0]
  assert (
    len(sudoku.solutions(''.join(ch for ch in example.prompt.split(':')[1] if ch.isdigit()))) == 1
  )


def test_gsm8k_rewards_by_hand():
  good = '<reasoning>\na\nb\n</reasoning>\n<answer>\n42\n</answer>\n'
  assert gsm8k.total_reward(good, '42') == pytest.approx(4.0)
  assert gsm8k.total_reward(good, '41') == pytest.approx(2.0)
  tail = good + 'xyz'  # text after the answer: strict fails, xml count loses 0.001 per char
  assert gsm8k.xml_count_reward(tail) == pytest.approx(0.5 - 3 * 0.001 - 3 * 0.001)
  assert gsm8k.total_reward(tail, '42') == pytest.approx(0.494 + 0.5 + 0.5 + 2.0)
  assert gsm8k.total_reward('<answer>-3</answer>', '-3') == pytest.approx(2.0)  # not isdigit
  assert gsm8k.total_reward('', '1') == 0.0
  example = tasks.TASKS['arithmetic'].examples('test', 1, seed=0)[0]
  assert tasks.TASKS['arithmetic'].is_correct(example, f'<answer>{example.answer}</answer>')


def test_gsm8k_jsonl_loader(tmp_path):
  path = tmp_path / 'train.jsonl'
  rows = [{'question': f'q{i}?', 'answer': f'step {i}\n#### 1,00{i}'} for i in range(5)]
  path.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
  task = tasks.get_task('gsm8k', data_path=str(path))
  examples = task.examples('train', 5, seed=0)
  assert sorted(e.answer for e in examples) == [f'100{i}' for i in range(5)]
  assert all(task.reward(e, e.response) == pytest.approx(4.0) for e in examples)
  assert examples[0].prompt.startswith(gsm8k.SYSTEM_PROMPT)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "q", "answer": "no marker"}\n')
  with pytest.raises(ValueError, match='bad.jsonl:1'):
    gsm8k.load_jsonl(str(bad))
  with pytest.raises(FileNotFoundError, match='does not exist'):
    gsm8k.load_jsonl(str(tmp_path / 'missing.jsonl'))
  with pytest.raises(ValueError, match='task_data'):
    tasks.get_task('gsm8k')
