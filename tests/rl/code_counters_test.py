"""RL's code outcome counters: a rollout of a code task logs the share of completions per sandbox
verdict (passed, failed, timeout, memory, crash, refused) in metrics.jsonl and the console line;
other tasks log none."""

import concurrent.futures
import json
import threading
import time

import pytest

from dlmjax import tasks
from dlmjax.rl import rollout
from dlmjax.tasks import code
from dlmjax.tasks import code_exec as ce
from dlmjax.train import reporting
from dlmjax.train.stages import rl as rl_stage
from tests.conftest import tiny_test_config

ROW = dict(
  task_id='t/0',
  prompt='def add(a, b):\n',
  canonical_solution='  return a + b\n',
  test='def check(candidate):\n  assert candidate(1, 2) == 3\n  assert candidate(2, 2) == 4\n',
  entry_point='add',
)
COMPLETIONS = {
  'passed': '  return a + b\n',
  'failed': '  return a * b\n',  # 1 * 2 != 3; 2 * 2 == 4: half the tests
  'timeout': '  while True:\n    pass\n',
  'crash': '  import os\n  os._exit(0)\n',
  'refused': '  import socket\n  socket.socket()\n',
}


def _reporter(run_dir):
  """The RL stage's console metrics on a reporter writing run_dir/metrics.jsonl."""
  stage = rl_stage.stage(tiny_test_config(**{'stage': 'rl'}))
  return reporting.Reporter(
    str(run_dir),
    total_steps=2,
    flops_per_token=0,
    peak_tflops=0.0,
    console_metrics=stage.console_metrics,
  )


def test_a_code_rollout_counts_each_verdict(tmp_path):
  path = tmp_path / 'humaneval.jsonl'
  path.write_text(json.dumps(ROW) + '\n')
  task = code.HumanEval(str(path), limits=ce.Limits(wall_s=1.5, cpu_s=1, memory_mb=256))
  example = task.examples('train', 1, seed=0)[0]
  names = [*COMPLETIONS, 'passed', 'passed', 'failed']  # 8 rows: 3 passed, 2 failed, 1 each
  texts = [COMPLETIONS[n] for n in names]
  rewards, failures, correct, counters = rollout.score_texts(task, [example] * len(texts), texts)
  assert list(rewards) == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5] and failures == 0
  assert correct == [n == 'passed' for n in names]
  assert counters == {
    'code_passed': 3 / 8,
    'code_failed': 2 / 8,
    'code_timeout': 1 / 8,
    'code_memory': 0.0,
    'code_crash': 1 / 8,
    'code_refused': 1 / 8,
  }
  # A rollout row carries them into metrics.jsonl and the next step's console line.
  reporter = _reporter(tmp_path)
  reporter.write_row(dict(step=1, rollout=0, **counters))
  assert json.loads((tmp_path / 'metrics.jsonl').read_text())['code_timeout'] == 1 / 8
  line = reporter._line(dict(step=1, loss=0.5, lr=1e-3, grad_norm=1.0))  # pylint: disable=protected-access
  assert 'code_passed 0.3750' in line and 'code_refused 0.1250' in line


def test_other_tasks_log_no_code_counters(tmp_path):
  task = tasks.get_task('countdown3')
  example = task.examples('train', 1, seed=0)[0]
  *_, counters = rollout.score_texts(task, [example], ['<answer>1+1</answer>'])
  assert counters == {}
  reporter = _reporter(tmp_path)
  reporter.write_row(dict(step=1, rollout=0, rollout_reward_mean=0.0, **counters))
  assert 'code_' not in reporter._line(dict(step=1, loss=0.5, lr=1e-3, grad_norm=1.0))  # pylint: disable=protected-access


def test_rewards_are_scored_while_the_log_probs_run():
  """The rollout scores on a host thread while the accelerator computes the log-probs: the
  sandboxes' seconds add nothing to the rollout when the log-probs take as long. Each side
  waits at a barrier for the other, which only two overlapping calls pass; each side's seconds
  are at least its sleep."""
  thread = concurrent.futures.ThreadPoolExecutor(1)
  both_running = threading.Barrier(2, timeout=10)

  def on_host():  # a sandbox batch, under way while the log-probs are
    both_running.wait()
    time.sleep(0.05)
    return 'rewards'

  def here():
    both_running.wait()  # raises BrokenBarrierError if on_host ran before or after, not beside
    time.sleep(0.05)
    return 'log-probs'

  (rewards, reward_s), (logprobs, logprob_s) = rollout.overlapped(thread, on_host, here)
  thread.shutdown()
  assert (rewards, logprobs) == ('rewards', 'log-probs')
  assert min(reward_s, logprob_s) >= 0.05, (reward_s, logprob_s)


@pytest.mark.refuses_without_boundary
def test_the_run_records_what_held_its_programs(tmp_path, monkeypatch, capsys):
  """A code run prints the sandbox line and keeps it in code_sandbox.json; with no OS boundary it
  stops before any program runs, unless rl.allow_unsandboxed_code opts in."""
  path = tmp_path / 'humaneval.jsonl'
  path.write_text(json.dumps(ROW) + '\n')
  config = tiny_test_config(**{'stage': 'rl', 'output_dir': str(tmp_path)})
  task = code.HumanEval(str(path))
  saved = lambda: json.loads((tmp_path / rl_stage.SANDBOX_FILE).read_text())  # noqa: E731
  if ce.boundary()[0] is not None:
    rl_stage.record_sandbox(config, task)
    assert saved() == dict(sandbox=ce.boundary()[1], boundary=True)
    assert ce.boundary()[1] in capsys.readouterr().out
  monkeypatch.setattr(ce, 'boundary', lambda: (None, 'code sandbox: NO operating-system boundary'))
  with pytest.raises(ce.SandboxUnavailable, match='rl.allow_unsandboxed_code=True'):
    task.sandbox()
  task.allow_unsandboxed = True
  rl_stage.record_sandbox(config, task)
  assert saved() == dict(sandbox=task.sandbox(), boundary=False) and 'opted in' in task.sandbox()
