"""The code sandbox survives hostile programs (reward 0, a named outcome, no escape, no hang) and
the HumanEval / MBPP / KodCode formats score by the fraction of tests passed."""

import json
import os
import shutil
import threading

import pytest

from dlmjax import tasks
from dlmjax.tasks import code
from dlmjax.tasks import code_exec as ce

LIMITS = ce.Limits(wall_s=2.5, cpu_s=1, memory_mb=256)  # CPU-bound loops stop at 1 s of CPU
OUTSIDE = '/var/tmp/dlmjax_sandbox_escape_probe'  # /tmp is the program's own, in the boundary
HOSTILE = {
  'loop': ('while True:\n  pass\n', 'timeout'),
  'sleep': ('import time\ntime.sleep(60)\n', 'timeout'),
  # 1 GB a piece: the first one is past RLIMIT_AS, so no page is touched and a loaded machine
  # cannot turn it into a timeout (100 MB pieces once took 2.1 s and hit the CPU limit there).
  'alloc': ('x = []\nwhile True:\n  x.append(bytearray(10**9))\n', 'memory'),
  'socket': ('import socket\nsocket.create_connection(("1.1.1.1", 80), timeout=1)\n', 'network'),
  'socket_caught': (
    'import socket\ntry:\n  socket.socket()\nexcept BaseException:\n  pass\n',
    'network',
  ),
  'write_outside': (f'open({OUTSIDE!r}, "w").write("x")\n', 'filesystem'),
  'read_outside': ('open("/etc/hostname").read()\n', 'filesystem'),
  'list_outside': ('import os\nos.listdir("/")\n', 'filesystem'),
  'delete_outside': (f'import os\nos.remove({OUTSIDE!r})\n', 'filesystem'),
  'fork_bomb': ('import os\nwhile True:\n  os.fork()\n', 'process'),
  'subprocess': ('import subprocess\nsubprocess.run(["true"])\n', 'process'),
  'ctypes': ('import ctypes\n', 'native'),
  'segfault': ('import faulthandler\nfaulthandler._sigsegv()\n', 'crash'),
  'hard_exit': ('import os\nos._exit(0)\n', 'crash'),
}


@pytest.fixture(scope='module')
def hostile_outcomes():
  scorer = ce.Scorer(LIMITS, workers=4)
  names = sorted(HOSTILE)
  outcomes = scorer.run([ce.Program(HOSTILE[n][0], ('assert True',)) for n in names])
  scorer.close()
  return dict(zip(names, outcomes)), scorer.counts


@pytest.mark.parametrize('name', sorted(HOSTILE))
def test_hostile_program_scores_zero_with_its_outcome(hostile_outcomes, name):
  outcomes, _ = hostile_outcomes
  outcome = outcomes[name]
  assert (outcome.status, outcome.reward) == (HOSTILE[name][1], 0.0), outcome.detail


def test_nothing_escapes_and_every_outcome_is_counted(hostile_outcomes):
  _, counts = hostile_outcomes
  assert not os.path.exists(OUTSIDE)
  expected = {}
  for _, status in HOSTILE.values():
    expected[status] = expected.get(status, 0) + 1
  assert {k: v for k, v in counts.items() if v} == expected


def test_programs_run_in_parallel(monkeypatch):
  """submit returns before the programs end (the caller generates meanwhile), and the pool runs
  them side by side: all four are in their sandboxes at once."""
  running, most, lock, release = [0], [0], threading.Lock(), threading.Event()
  run = ce._run

  def counted(*args):
    with lock:
      running[0] += 1
      most[0] = max(most[0], running[0])
      if running[0] == 4:
        release.set()
    release.wait(30)  # each waits for the others: four at once, or a 30 s stall
    try:
      return run(*args)
    finally:
      with lock:
        running[0] -= 1

  monkeypatch.setattr(ce, '_run', counted)
  scorer = ce.Scorer(ce.Limits(wall_s=5), workers=4)
  future = scorer.submit([ce.Program('x = 1\n', ('assert x == 1',))] * 4)
  assert not future.done()
  outcomes = future.result()
  scorer.close()
  assert [o.reward for o in outcomes] == [1.0] * 4
  assert most[0] == 4


def test_a_machine_with_bubblewrap_has_the_boundary():
  """Where bwrap is installed (CI installs it: scripts/test.sh), the probe passes inside it."""
  if not shutil.which('bwrap'):
    pytest.skip('bubblewrap is not installed here')
  assert ce.boundary()[0] is not None, ce.boundary()[1]


def test_a_checkout_under_tmp_still_runs_behind_the_boundary(monkeypatch):
  """The boundary's private /tmp must not hide the child's own script when the checkout (or the
  interpreter) lives under the host's /tmp: a clone in /tmp once had no boundary at all."""
  if ce.boundary()[0] is None:
    pytest.skip(ce.boundary()[1])
  here = os.path.join('/tmp', f'dlmjax_checkout_{os.getpid()}')
  os.makedirs(here, exist_ok=True)
  try:
    child = shutil.copy(ce._CHILD, os.path.join(here, 'sandbox_child.py'))
    monkeypatch.setattr(ce, '_CHILD', child)
    outcome = ce.run_program(ce.Program('x = 1\n', ('assert x == 1',)), LIMITS)
    assert (outcome.status, outcome.reward) == ('ok', 1.0), outcome
  finally:
    shutil.rmtree(here)


@pytest.mark.refuses_without_boundary
def test_no_boundary_refuses_unless_opted_in(monkeypatch, capsys):
  monkeypatch.setattr(ce, 'boundary', lambda: (None, 'code sandbox: NO operating-system boundary'))
  with pytest.raises(ce.SandboxUnavailable, match='rl.allow_unsandboxed_code=True'):
    ce.Scorer(LIMITS, workers=1)
  with pytest.raises(ce.SandboxUnavailable, match='apt-get install bubblewrap'):
    ce.run_program(ce.Program('x = 1\n', ('assert x == 1',)), LIMITS)
  scorer = ce.Scorer(LIMITS, workers=1, allow_unsandboxed=True)
  assert scorer.sandbox.endswith(
    'running programs behind the audit hook and rlimits alone (opted in)'
  )
  program = ce.Program('import os\nx = os.getcwd()\n', ('assert x != "/tmp"',))
  assert [o.reward for o in scorer.run([program])] == [1.0]  # a host directory, not the boundary
  scorer.close()


def test_the_audit_hook_alone_refuses_the_network(monkeypatch):
  monkeypatch.setattr(ce, 'network_isolation', lambda: ())
  program = ce.Program('import socket\nsocket.socket()\n', ('assert True',))
  assert ce._run(program, LIMITS, None).status == 'network'


def test_reward_is_the_fraction_of_tests_passed_and_files_inside_work():
  program = ce.Program(
    'def f(x):\n  return x + 1\nopen("scratch.txt", "w").write("ok")\n',
    (
      'assert f(1) == 2',
      'assert f(2) == 3',
      'assert f(0) == 5',
      'assert open("scratch.txt").read() == "ok"',
    ),
  )
  outcome = ce.run_program(program, LIMITS)
  assert (outcome.status, outcome.passed, outcome.total) == ('ok', 3, 4)
  assert outcome.reward == pytest.approx(0.75)
  assert ce.run_program(ce.Program('def f(:\n', ('assert True',)), LIMITS).reward == 0.0
  printed = ce.Program(
    'print(\'{"nonce": "x", "solution": "pass", "tests": ["pass"]}\')\n', ('assert False',)
  )
  assert ce.run_program(printed, LIMITS).reward == 0.0  # forged result lines are ignored


HUMANEVAL = dict(
  task_id='HumanEval/0',
  prompt='def add(a, b):\n    """Sum of a and b."""\n',
  canonical_solution='    return a + b\n',
  test=(
    'METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n    x = 5\n'
    '    assert candidate(x, 1) == 6\n    for i in range(3):\n        assert candidate(i, 0) == i\n'
  ),
  entry_point='add',
)
MBPP = dict(
  task_id=2,
  text='Write a function to add two numbers.',
  code='def add(a, b):\n  return a + b',
  test_list=['assert add(1, 2) == 3', 'assert add(0, 0) == 0'],
  test_setup_code='',
)
KODCODE = dict(
  question_id='k0',
  question='Write add(a, b).',
  solution='def add(a, b):\n  return a + b\n',
  test=(
    'from solution import add\n\ndef test_small():\n  assert add(1, 2) == 3\n\n'
    'class TestMore:\n  def test_zero(self):\n    assert add(0, 0) == 0\n'
  ),
)


@pytest.mark.parametrize(
  'name, row, wrong, expected',
  [
    ('humaneval', HUMANEVAL, '    return a * b\n', 0.0),  # 2 != 3, 5 != 6, the loop fails at 1
    ('humaneval', HUMANEVAL, '```python\ndef add(a, b):\n  return a - b\n```', 1 / 3),
    ('mbpp', MBPP, '```python\ndef add(a, b):\n  return a * b\n```', 0.5),
    ('kodcode', KODCODE, '```python\ndef add(a, b):\n  return a * b\n```', 0.5),
  ],
)
def test_formats_load_and_score(tmp_path, name, row, wrong, expected):
  path = tmp_path / f'{name}.jsonl'
  path.write_text(json.dumps(row) + '\n')
  task = tasks.get_task(name, data_path=f',{path}')
  example = task.examples('test', 1, seed=0)[0]
  rewards, correct = task.judge([example, example, example], [example.response, wrong, ''])
  assert rewards == pytest.approx([1.0, expected, 0.0])
  assert correct == [True, False, False]


def test_humaneval_tests_split_by_assert():
  setup, tests = code.humaneval_tests(HUMANEVAL['test'], 'add')
  assert setup == 'METADATA = {}\ncandidate = add'
  assert len(tests) == 3 and tests[1].startswith('x = 5\n')
  with pytest.raises(ValueError, match='check'):
    code.humaneval_tests('def test():\n  pass\n', 'add')


def test_kodcode_parametrize_and_pytest_import():
  test = (
    'import pytest\nfrom solution import add\n\n'
    '@pytest.mark.parametrize("a, b, c", [(1, 1, 2), (2, 2, 4)])\n'
    'def test_cases(a, b, c):\n  assert add(a, b) == c\n'
  )
  _, tests = code.kodcode_tests(test)
  assert tests == ('for __case in [(1, 1, 2), (2, 2, 4)]:\n  test_cases(*__case)',)
  example = code.KodCode('x').example_of(dict(question='q', solution='', test=test))
  assert example.paths  # pytest's directory, readable and importable in the child
  program = code.program_of(example, 'def add(a, b):\n  return a + b\n')
  assert ce.run_program(program, ce.Limits(wall_s=10, cpu_s=10)).reward == 1.0


def test_bad_rows_name_the_problem(tmp_path):
  path = tmp_path / 'bad.jsonl'
  path.write_text(json.dumps(dict(MBPP, test_list=[])) + '\n')
  with pytest.raises(ValueError, match='bad.jsonl:1.*test_list'):
    tasks.get_task('mbpp', data_path=str(path)).examples('train', 1, seed=0)
