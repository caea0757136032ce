"""When a process of a multi-process run dies, the others end with one line, not JAX's dump.

JAX's coordination service declares a process dead when its heartbeats stop
(HEARTBEAT_TIMEOUT_S, parallel/distributed.py) or, for process 0, which runs the service, as soon
as its connection drops; every other process is then ended by the C++ runtime with a fatal log,
a stack trace and Python's "Fatal Python error: Aborted" thread dump (jaxlib offers no Python
hook: its missed-heartbeat callback cannot be called from Python). Before that, a survivor
usually prints the traceback of the collective that lost its peer.

So each process of a multi-process run sends its stderr (fd 2: Python and C++ alike) through a
small watcher process (this module, started by `start`). The watcher passes every line on at
once, except from a Python traceback or a C++ error log on, which it holds: if JAX's "detected
fatal errors" abort follows, it drops what it held and prints one `error:` line naming the
process that died, the last complete checkpoint and the command that resumes; otherwise (the
output ends, or nothing fatal follows within the hold time) it passes the held lines on
unchanged. docs/faults.md, A process of a multi-process run dies.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time

from dlmjax.checkpoint import steps as steps_lib

# Lines of JAX's coordination-service abort (client.h's fatal log, the agent's error poll, the
# service propagating a dead task to the others).
FATAL_MARKS = (
  'JAX distributed service detected fatal errors',
  'Polled an error from coordination service',
  'Use error polling to propagate',
)
# A held block starts at a Python traceback or a C++ (absl) ERROR / FATAL log line.
_HOLD_FROM = re.compile(rb'^(Traceback \(most recent call last\):|[EF]\d{4} \d\d:\d\d:\d\d\.\d+ )')


def dead_processes(text: str, process_id: int) -> list[int]:
  """The processes JAX's abort text names as dead (never this one); [] when it names none."""
  listed = re.search(r'stopped sending heartbeats\):\s*([\d,\s]+)', text)
  if listed:
    dead = {int(i) for i in re.findall(r'\d+', listed.group(1))}
  else:
    dead = {int(i) for i in re.findall(r'Task (\d+) heartbeat timeout', text)}
  if not dead and 'leader task was preempted' in text:  # process 0's service went away
    dead = {0}
  return sorted(dead - {process_id})


def message(dead: list[int], num_processes: int, checkpoint_dir: str, command: str) -> str:
  """The one line a survivor ends with."""
  if dead:
    who = f'process {", ".join(map(str, dead))} of {num_processes}'
    if 0 in dead:
      who += " (it runs JAX's coordination service)"
  else:
    who = f'another of the {num_processes} processes'
  steps = steps_lib.committed_steps(checkpoint_dir)
  if steps:
    where = (
      f'the last complete checkpoint is step {steps[-1]} '
      f'({os.path.join(checkpoint_dir, str(steps[-1]))}); to resume from it'
    )
  else:
    where = f'no checkpoint under {checkpoint_dir} is complete yet; to start again'
  return (
    f'error: {who} stopped (killed, preempted or crashed: see its own log), so this process '
    f'stopped too; {where}, start all {num_processes} processes with the same command: '
    f'{command}'
  )


class StderrFilter:
  """Passes lines to `write`, holding them from a traceback or C++ error log on (see above)."""

  def __init__(self, write, hold_s: float, clock=time.monotonic):
    self._write, self._hold_s, self._clock = write, hold_s, clock
    self._pending = b''
    self._held: list[bytes] = []
    self._held_since: float | None = None
    self.fatal = False

  def feed(self, data: bytes) -> None:
    self._pending += data
    # Lines end in \n; a progress bar redraws itself with \r.
    while (end := _line_end(self._pending)) >= 0:
      line, self._pending = self._pending[: end + 1], self._pending[end + 1 :]
      self._line(line)

  def _line(self, line: bytes) -> None:
    if self._held_since is None and _HOLD_FROM.match(line):
      self._held_since = self._clock()
    if self._held_since is None:
      self._write(line)
      return
    self._held.append(line)
    self.fatal = self.fatal or any(mark.encode() in line for mark in FATAL_MARKS)

  def tick(self) -> None:
    """Releases a held block nothing fatal followed within the hold time, and a partial line."""
    if self._held_since is not None and not self.fatal:
      if self._clock() - self._held_since >= self._hold_s:
        self._release()
    if self._held_since is None and self._pending:
      self._write(self._pending)
      self._pending = b''

  def _release(self) -> None:
    for line in self._held:
      self._write(line)
    self._held, self._held_since = [], None

  def close(self) -> str | None:
    """At the end of the output: JAX's abort text if it came (and was dropped), else None."""
    if self._pending:
      self._line(self._pending)
      self._pending = b''
    if self.fatal:
      return b''.join(self._held).decode(errors='replace')
    self._release()
    return None


def _line_end(data: bytes) -> int:
  ends = [i for i in (data.find(b'\n'), data.find(b'\r')) if i >= 0]
  return min(ends) if ends else -1


def _write_all(fd: int, data: bytes) -> None:
  try:
    while data:
      data = data[os.write(fd, data) :]
  except OSError:  # whoever read our output is gone
    pass


_watcher: subprocess.Popen | None = None
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(process_id: int, num_processes: int, heartbeat_timeout_s: int, checkpoint_dir: str):
  """Routes this process's fd 2 through a watcher process (once); call before JAX starts."""
  global _watcher  # pylint: disable=global-statement
  if _watcher is not None:
    return
  command = shlex.join(['python', '-m', 'dlmjax.train', *sys.argv[1:]])
  hold_s = heartbeat_timeout_s + 30  # the abort comes within the heartbeat timeout
  read, write = os.pipe()
  _watcher = subprocess.Popen(
    [sys.executable, '-m', __name__, str(process_id), str(num_processes), str(hold_s)]
    + [checkpoint_dir, command],
    stdin=read,
    stdout=sys.stderr.fileno(),
    stderr=sys.stderr.fileno(),
    env=dict(os.environ, PYTHONPATH=os.pathsep.join([_PACKAGE_ROOT, *sys.path])),
  )
  os.close(read)
  sys.stderr.flush()
  os.dup2(write, 2)  # the watcher reads until every writer of fd 2 is gone: this process's end
  os.close(write)


def main(argv: list[str]) -> None:
  process_id, num_processes, hold_s, checkpoint_dir, command = argv
  # Ctrl-C and a scheduler's SIGTERM are the trainer's to handle; the watcher ends at its end.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  lines = StderrFilter(lambda data: _write_all(1, data), float(hold_s))
  while True:
    if select.select([0], [], [], 0.5)[0]:
      data = os.read(0, 1 << 16)
      if not data:
        break
      lines.feed(data)
    lines.tick()
  aborted = lines.close()
  if aborted is not None:
    dead = dead_processes(aborted, int(process_id))
    line = message(dead, int(num_processes), checkpoint_dir, command)
    _write_all(1, (line + '\n').encode())


if __name__ == '__main__':
  main(sys.argv[1:])
