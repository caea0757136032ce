# ruff: noqa: E501 (JAX's log lines, verbatim)
"""The stderr watcher of a multi-process run, on the text JAX 0.10.2 really printed when a peer
was killed (tests/parallel/peer_failure_test.py runs the whole thing)."""

import os

import pytest

from dlmjax.train import peer_watch

# Process 0 (the service) after process 1 was killed: the collective's traceback, then the
# service's verdict and the client's fatal log, the stack trace and Python's thread dump.
_TRACEBACK = b"""Traceback (most recent call last):
  File "/x/jax/_src/array.py", line 623, in _value
    npy_value, did_copy = self._single_device_array_to_np_array_did_copy()
jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: Read error [127.0.0.1]:7381: Connection reset by peer
"""
_SERVICE_SAW_1_DIE = b"""E1202 05:35:53.161874    6510 coordination_service.cc:1549] [6034839868917247792] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1202 05:35:53.162612    6521 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1202 05:35:53.162393    2483 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
*** Check failure stack trace: ***
    @     0x7fe395c40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
Fatal Python error: Aborted

Current thread 0x00007fe39e654b80 (most recent call first):
  File "/x/jax/_src/distributed.py", line 199 in shutdown
"""
# Process 1 after process 0 (which runs the service) was killed.
_LEADER_DIED = b"""E1202 05:36:25.806673    6789 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1202 05:36:25.806710    6789 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
"""
# The shutdown barrier's variant (a survivor already exiting when the verdict came).
_SHUTDOWN_BARRIER = (
  b'F1202 05:34:04.962393    2483 client.h:80] Terminating process because the JAX distributed '
  b'service detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has failed.\n'
  b"Barrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 3 "
  b'heartbeat timeout. This indicates that the remote task has failed\n'
)


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _filter(hold_s=10.0):
  written, clock = [], _Clock()
  return peer_watch.StderrFilter(written.append, hold_s, clock), written, clock


@pytest.mark.parametrize(
  'text,process_id,dead',
  [
    (_SERVICE_SAW_1_DIE, 0, [1]),
    (_LEADER_DIED, 1, [0]),
    (_SHUTDOWN_BARRIER, 0, [3]),
    (_TRACEBACK, 0, []),
  ],
)
def test_dead_processes_reads_jax_abort_text(text, process_id, dead):
  assert peer_watch.dead_processes(text.decode(), process_id) == dead


def test_lines_pass_at_once_until_a_traceback_and_the_abort_drops_the_rest():
  lines, written, _ = _filter()
  lines.feed(b'step 3/4 | loss 8.1\nstep 4')
  assert written == [b'step 3/4 | loss 8.1\n']  # a partial line waits for its end ...
  lines.tick()
  assert written[-1] == b'step 4'  # ... or for the next tick
  lines.feed(b'/4 | loss 8.0\r' + _TRACEBACK[:50])
  assert written[-1] == b'/4 | loss 8.0\r'  # a progress bar's redraw passes at once
  lines.feed(_TRACEBACK[50:] + _SERVICE_SAW_1_DIE)
  lines.tick()
  assert b''.join(written) == b'step 3/4 | loss 8.1\nstep 4/4 | loss 8.0\r'
  assert lines.fatal
  aborted = lines.close()
  assert 'Gloo AllGather failed' in aborted and 'Fatal Python error' in aborted
  assert b''.join(written) == b'step 3/4 | loss 8.1\nstep 4/4 | loss 8.0\r'


def test_a_traceback_without_the_abort_passes_unchanged():
  lines, written, clock = _filter()
  lines.feed(b'before\n' + _TRACEBACK)
  assert written == [b'before\n']
  assert lines.close() is None  # the process ended without JAX's abort: an ordinary error
  assert b''.join(written) == b'before\n' + _TRACEBACK
  # An error log mid-run that nothing fatal follows is passed on after the hold time.
  lines, written, clock = _filter(hold_s=10.0)
  lines.feed(b'E1202 05:35:53.161874    6510 gloo.cc:1] a transient error\nstep 5\n')
  clock.now = 9.0
  lines.tick()
  assert written == []
  clock.now = 10.0
  lines.tick()
  assert (
    b''.join(written) == b'E1202 05:35:53.161874    6510 gloo.cc:1] a transient error\nstep 5\n'
  )
  lines.feed(b'step 6\n')
  assert written[-1] == b'step 6\n'


def test_message_names_the_dead_process_the_last_complete_checkpoint_and_the_command(tmp_path):
  checkpoints = str(tmp_path / 'checkpoints')
  command = 'python -m dlmjax.train --config=configs/tiny.py'
  none_yet = peer_watch.message([1], 2, checkpoints, command)
  assert none_yet.startswith('error: process 1 of 2 stopped')
  assert f'no checkpoint under {checkpoints} is complete yet; to start again' in none_yet
  # Complete: digit-named with its params. Not: orbax's temporary directory, one set aside.
  for name in ('2', '4', '6.orbax-checkpoint-tmp-17', '8.corrupt'):
    os.makedirs(os.path.join(checkpoints, name, 'params'))
  line = peer_watch.message([0], 8, checkpoints, command)
  assert line == (
    "error: process 0 of 8 (it runs JAX's coordination service) stopped (killed, preempted or "
    'crashed: see its own log), so this process stopped too; the last complete checkpoint is '
    f'step 4 ({checkpoints}/4); to resume from it, start all 8 processes with the same '
    f'command: {command}'
  )
  assert '\n' not in line
  assert peer_watch.message([], 2, checkpoints, command).startswith(
    'error: another of the 2 processes stopped'
  )
