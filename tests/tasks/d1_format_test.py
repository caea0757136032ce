"""The `countdown` and `sudoku` file tasks read d1's data formats (dllm-reasoning/d1: dataset/,
diffu-grpo/data_utils.py) and score as d1's reward and eval code do, pinned on hand-written rows
in those formats (expected values checked against d1's functions when this was written)."""

import json

import pytest

from dlmjax import tasks
from dlmjax.tasks import countdown, sudoku

D1_SYSTEM = (
  '\nRespond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n'
)


def _countdown(tmp_path, rows):
  path = tmp_path / 'countdown.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return tasks.get_task('countdown', data_path=f',{path}')


def test_countdown_rows_of_both_d1_sources_get_d1s_prompt(tmp_path):
  # d1's test file (dataset/countdown_cd3_test.jsonl) and Countdown-Tasks-3to4 (its training set).
  task = _countdown(tmp_path, [{'input': '30,100,93', 'output': '23'}])
  (example,) = task.examples('test', 0, seed=0)
  assert example.prompt == (
    D1_SYSTEM + '\nUsing only the numbers [30, 100, 93], create an arithmetic expression that '
    'evaluates to exactly 23. You must use all numbers from the list, and each number must be '
    'used exactly once. You may use the operations +, -, *, and / as needed. After reasoning, '
    'provide only your final expression inside <answer></answer> tags without including an '
    'equals sign or the target number. For example, if the numbers are [2, 3, 4] and the target '
    'is 5, a valid answer is: <answer>\n2*4-3\n</answer>'
  )
  hub = countdown.CountdownFile('').example_of({'nums': [44, 19, 35], 'target': 98})
  assert 'Using only the numbers [44, 19, 35], ' in hub.prompt and hub.numbers == (44, 19, 35)


@pytest.mark.parametrize(
  'completion, reward, d1_eval',
  [
    ('<reasoning>\n100-93=7\n</reasoning>\n<answer>\n30-(100-93)\n</answer>\n', 1.0, 0.0),
    ('<answer>30+100-93</answer>', 0.1, 0.0),  # the numbers, a wrong value
    ('<answer>100-77</answer>', 0.1, 0.0),  # other numbers
    ('<answer>30-(100-93) = 23</answer>', 0.1, 1.0),  # RL counts 23 as a number; eval cuts '= 23'
    ('<answer>1</answer> then <answer>30 - (100 - 93)</answer>', 1.0, 0.0),  # the last tags
    ('<answer>30-(100-93)/0</answer>', 0.1, 0.0),
    ('30-(100-93)', 0.0, 1.0),  # no tags: d1's eval scores the bare completion
    ('\\boxed{30 - (100 - 93)}', 0.0, 1.0),  # d1's eval prompt asks for a box
    ('x \\boxed{30 \\times 1} y', 0.0, 0.0),
    ('\\fbox{30-(100-93)}', 0.0, 0.0),  # d1's remove_boxed keeps \fbox: not an expression
    ('<answer>30-(100-93)</answer> \\boxed{30-(100-93)', 1.0, 1.0),  # unclosed: the tags
  ],
)
def test_countdown_reward_and_eval_are_d1s(tmp_path, completion, reward, d1_eval):
  task = _countdown(tmp_path, [{'input': '30,100,93', 'output': '23'}])
  (example,) = task.examples('test', 0, seed=0)
  metrics = task.metrics([example], [completion])
  assert task.reward(example, completion) == pytest.approx(reward)
  assert metrics['accuracy'] == [float(reward == 1.0)]
  assert metrics['d1_eval'] == [d1_eval]


def test_sudoku_csv_in_d1s_format_keeps_leading_zeros(tmp_path):
  path = tmp_path / '4x4_test_sudoku.csv'  # d1's columns; a CSV reader takes 0140... for a number
  path.write_text(
    'Puzzle,Solution\n3102200002100320,3142243142131324\n0140432014020000,2143432114323214\n'
  )
  task = tasks.get_task('sudoku', data_path=f',{path}')
  examples = sorted(task.examples('test', 0, seed=0), key=lambda e: e.answer)
  assert [e.answer for e in examples] == ['2143432114323214', '3142243142131324']
  assert examples[0].prompt == (
    sudoku.D1_SYSTEM_PROMPT + '\n\nSolve the following Sudoku puzzle: 0140432014020000\n'
  )
  assert sudoku.D1_SYSTEM_PROMPT.startswith(
    '\nPlease solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character '
    "string reading left-to-right, top-to-bottom, where '0' represents empty cells.\n\nRules:\n"
  ) and sudoku.D1_SYSTEM_PROMPT.endswith(
    '<answer>\n[16-character solution string with no spaces or separators]\n</answer>\n'
  )
  assert task.reward(examples[0], examples[0].response) == 1.0
  with pytest.raises(ValueError, match='does not fill'):
    sudoku.SudokuFile('').example_of({'Puzzle': '3102200002100320', 'Solution': '1' * 16})


@pytest.mark.parametrize(
  'completion, reward, d1_eval',
  [
    ('<answer>\n2143432114323214\n</answer>', 1.0, 1.0),
    ('<answer>2143 4321 1432 3214</answer>', 1.0, 1.0),  # whitespace dropped by both
    ('<answer>[2143432114323214]</answer>', 1.0, 0.0),  # RL keeps digits only, eval all but spaces
    ('<answer>21434321</answer>', 0.375, 0.375),  # padded with 0: 3 of the 8 blanks right
    ('<reasoning>2143432114323214</reasoning>', 0.0, 1.0),  # eval's last pattern: any 16 digits
    ('<answer></answer> 2143432114323214', 0.0, 1.0),  # eval: the text after </answer>
    ('no answer', 0.0, 0.0),
  ],
)
def test_sudoku_reward_and_eval_are_d1s(completion, reward, d1_eval):
  task = sudoku.SudokuFile('')
  example = task.example_of({'Puzzle': '0140432014020000', 'Solution': '2143432114323214'})
  assert task.reward(example, completion) == pytest.approx(reward)
  assert task.metrics([example], [completion])['d1_eval'] == [pytest.approx(d1_eval)]
