"""MATH answers: box extraction, normalisation, CAS equivalence, d1's MATH reward and the loader."""

import json

import pytest

from dlmjax import tasks
from dlmjax.tasks import math500
from dlmjax.tasks import math_answer as ma


@pytest.mark.parametrize(
  'text, expected',
  [
    ('so \\boxed{\\frac{1}{2}} and then \\boxed{\\frac{\\sqrt{3}}{2}}.', '\\frac{\\sqrt{3}}{2}'),
    ('\\boxed{\\{1, \\{2\\}\\}}', '\\{1, \\{2\\}\\}'),
    ('$\\fbox{7}$', '7'),
    ('\\boxed 5$ done', '5'),
    ('cut off \\boxed{\\frac{1}{', None),
    ('<answer>\n12\n</answer>', '12'),
    ('<answer>so \\boxed{3}</answer>', '3'),
    ('Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.', '\\frac{3}{4}'),
    ('The answer is 42', '42'),
    ('no answer here', None),
  ],
)
def test_extract_answer(text, expected):
  assert ma.extract_answer(text) == expected


@pytest.mark.parametrize(
  'a, b',
  [
    ('0.5', '\\frac{1}{2}'),
    ('\\dfrac{3}{4}', '3/4'),
    ('\\tfrac12', '\\frac{1}{2}'),
    ('\\sqrt{2}/2', '\\frac{\\sqrt2}{2}'),
    ('10\\%', '10'),
    ('90^\\circ', '90'),
    ('\\$5.00', '5'),
    ('5\\text{ cm}', '5'),
    ('x=3', '3'),
    ('\\text{(A)}', 'A'),
    ('(A)', 'A'),
    ('(1, 2]', '(1,2]'),
    ('(3, 4)', '(3,4)'),
    ('\\left( 3, 4 \\right)', '(3,4)'),
    ('1,000', '1000'),
    ('2\\sqrt{2}', '\\sqrt{8}'),  # CAS only
    ('\\frac{2}{4}', '0.5'),  # CAS only
  ],
)
def test_equivalent_forms(a, b):
  assert ma.is_equiv(a, b) and ma.is_equiv(b, a)


@pytest.mark.parametrize(
  'a, b',
  [
    ('2', '3'),
    ('(1,2)', '(1,2]'),
    ('(3,4)', '(4,3)'),
    ('\\frac{1}{3}', '0.3'),
    ('A', 'B'),
    ('', '1'),
  ],
)
def test_different_answers(a, b):
  assert not ma.is_equiv(a, b)
  assert not ma.is_equiv(None, b)


def test_cas_is_what_proves_the_symbolic_cases(monkeypatch):
  assert ma.cas_available()
  monkeypatch.setattr(ma, '_math_verify', lambda: None)
  assert not ma.is_equiv('2\\sqrt{2}', '\\sqrt{8}')
  assert ma.is_equiv('0.5', '\\frac{1}{2}')  # the normalisation alone


def test_math500_reward_and_loader(tmp_path):
  rows = [
    {'problem': 'Half of one?', 'solution': 'It is $\\boxed{\\frac{1}{2}}$.'},
    {'problem': 'Two plus two?', 'solution': 'Four.', 'answer': '4'},
  ]
  path = tmp_path / 'math.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  task = tasks.get_task('math500', data_path=f',{path}')
  examples = task.examples('test', 2, seed=0)
  assert sorted(e.answer for e in examples) == ['4', '\\frac{1}{2}']
  for e in examples:
    assert e.prompt.startswith(tasks.gsm8k.SYSTEM_PROMPT) and '\\boxed{}' in e.prompt
    assert task.reward(e, e.response) == pytest.approx(3.0)
  half = next(e for e in examples if e.answer != '4')
  assert task.reward(half, '<answer>\\boxed{0.5}</answer>') == pytest.approx(3.0)
  assert task.reward(half, '<answer>0.5</answer>') == pytest.approx(2.75)  # no box in the tags
  assert task.reward(half, '\\boxed{0.5}') == pytest.approx(2.5)  # no tags
  assert task.reward(half, '<answer>\\boxed{0.4}</answer>') == pytest.approx(1.0)
  assert task.is_correct(half, 'the answer is \\boxed{\\dfrac12}')
  assert math500.format_reward('') == pytest.approx(0.25)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"problem": "q", "solution": "no box"}\n')
  with pytest.raises(ValueError, match='bad.jsonl:1.*answer'):
    tasks.get_task('math500', data_path=str(bad)).examples('train', 1, seed=0)
  with pytest.raises(ValueError, match='math500 needs its data'):
    tasks.get_task('math500')
