"""Executed-code rewards: a completion and its tests run in a sandboxed subprocess.

What is enforced, per program (docs/evaluation.md, Code sandbox):
  process    a fresh `python -I -S -B` (isolated: no site-packages, no user env, no .pyc) in its
             own temporary directory, its own session (the whole group is killed at the end)
  time       wall clock (the parent kills the group) and RLIMIT_CPU
  memory     RLIMIT_AS; a MemoryError anywhere ends the program as 'memory'
  files      RLIMIT_FSIZE, RLIMIT_NOFILE; an audit hook (sys.addaudithook) refuses writing,
             deleting, renaming or listing outside the directory and reading outside it and
             the interpreter's own library directories
  network    a network namespace of its own (`unshare -n`, or `unshare -rn` unprivileged) when
             the machine allows one, and in every case the audit hook refusing any socket.* event
  processes  the hook refuses fork, exec, spawn, system, subprocess and kill; RLIMIT_NPROC too
             (not enforced for root), ctypes is refused (it could call around the hook)
An audit hook is a tripwire for generated code, not a boundary against an adversary who writes
code to defeat it (CPython's docs say as much); the namespace and rlimits hold regardless.
The reward is the fraction of tests passed by a program that ran to its end; a program that was
stopped (time, memory, a refused operation, a crash) scores 0 and counts under its outcome.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from dlmjax.tasks import sandbox_child

_CHILD = os.path.abspath(sandbox_child.__file__)
_KINDS_BY_CODE = {code: kind for kind, code in sandbox_child.EXIT_CODES.items()}
OUTCOMES = ('ok', 'timeout', 'memory', 'network', 'filesystem', 'process', 'native', 'crash')
# What a batch's programs came to, as RL logs it: every test passed / a program that ran to its
# end but failed some test (or its solution raised) / stopped at the time limit / at the memory
# limit / crashed (a signal, an early exit, no valid report) / an operation the sandbox refused.
VERDICTS = ('passed', 'failed', 'timeout', 'memory', 'crash', 'refused')
_REFUSED = ('network', 'filesystem', 'process', 'native')


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_s: float = 3.0
  cpu_s: int = 3
  memory_mb: int = 512
  file_mb: int = 16


@dataclasses.dataclass(frozen=True)
class Program:
  """What runs: the solution, then setup (not counted), then each test in one namespace."""

  solution: str
  tests: tuple[str, ...]
  setup: str = ''
  paths: tuple[str, ...] = ()  # directories the program may import from (read-only)


@dataclasses.dataclass(frozen=True)
class Outcome:
  status: str  # one of OUTCOMES
  passed: int
  total: int
  seconds: float
  detail: str = ''  # per-test results or the refusal line

  @property
  def reward(self) -> float:
    return self.passed / self.total if self.status == 'ok' and self.total else 0.0

  @property
  def verdict(self) -> str:
    """One of VERDICTS."""
    if self.status == 'ok':
      return 'passed' if self.reward >= 1.0 else 'failed'
    return 'refused' if self.status in _REFUSED else self.status


def verdict_fractions(outcomes) -> dict[str, float]:
  """{'code_passed': share of the outcomes, ... one per VERDICTS}: RL's per-rollout counters."""
  counts = {v: 0 for v in VERDICTS}
  for o in outcomes:
    counts[o.verdict] += 1
  return {f'code_{v}': n / max(len(outcomes), 1) for v, n in counts.items()}


@functools.cache
def network_isolation() -> tuple[str, ...]:
  """The command prefix that gives a child no network: ('unshare', '-n'), '-rn', or ()."""
  unshare = shutil.which('unshare')
  for flags in ('-n', '-rn'):
    if unshare and subprocess.run([unshare, flags, 'true'], capture_output=True).returncode == 0:
      return (unshare, flags)
  return ()


@functools.cache
def _read_roots() -> tuple[str, ...]:
  """Directories a program may read: the interpreter's library (imports), and its platlib."""
  import sysconfig  # pylint: disable=import-outside-toplevel

  paths = sysconfig.get_paths()
  roots = {sys.base_prefix, sys.base_exec_prefix, paths['stdlib'], paths['platstdlib']}
  return tuple(sorted(os.path.realpath(p) for p in roots if p))


def run_program(program: Program, limits: Limits = Limits()) -> Outcome:
  """Runs one program in the sandbox; never raises for anything the program does."""
  start = time.monotonic()
  work = tempfile.mkdtemp(prefix='dlmjax-sandbox-')
  read_fd, write_fd = os.pipe()
  try:
    nonce = secrets.token_hex(16)
    spec = dict(
      solution=program.solution,
      setup=program.setup,
      tests=list(program.tests),
      nonce=nonce,
      memory_mb=limits.memory_mb,
      cpu_s=max(1, int(limits.cpu_s)),
      file_mb=limits.file_mb,
      read_roots=_read_roots() + tuple(os.path.realpath(p) for p in program.paths),
      paths=list(program.paths),
    )
    spec_path = os.path.join(work, 'spec.json')
    with open(spec_path, 'w') as f:
      json.dump(spec, f)
    command = [*network_isolation(), sys.executable, '-I', '-S', '-B', _CHILD, spec_path]
    log_path = os.path.join(work, 'output.log')
    with open(log_path, 'wb') as log:
      proc = subprocess.Popen(
        [*command, str(write_fd)],
        cwd=work,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        pass_fds=(write_fd,),
        start_new_session=True,
        env={'PATH': '/usr/bin:/bin', 'HOME': work, 'TMPDIR': work, 'PYTHONHASHSEED': '0'},
      )
    os.close(write_fd)
    write_fd = -1
    timed_out = False
    try:
      proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
      timed_out = True
    _kill_group(proc)
    os.set_blocking(read_fd, False)
    message = _read_all(read_fd)
    return _outcome(
      proc.returncode, timed_out, message, nonce, len(program.tests), _tail(log_path), start
    )
  finally:
    if write_fd >= 0:
      os.close(write_fd)
    os.close(read_fd)
    shutil.rmtree(work, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _read_all(fd: int, cap: int = 1 << 20) -> bytes:
  chunks, size = [], 0
  while size < cap:
    try:
      chunk = os.read(fd, 65536)
    except BlockingIOError:
      break
    if not chunk:
      break
    chunks.append(chunk)
    size += len(chunk)
  return b''.join(chunks)


def _tail(path: str, size: int = 400) -> str:
  try:
    with open(path, 'rb') as f:
      f.seek(max(0, os.path.getsize(path) - size))
      return f.read().decode(errors='replace').strip()
  except OSError:
    return ''


def _outcome(code, timed_out, message, nonce, total, log, start) -> Outcome:
  seconds = time.monotonic() - start
  if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
    return Outcome('timeout', 0, total, seconds, log)
  if code in _KINDS_BY_CODE:
    return Outcome(_KINDS_BY_CODE[code], 0, total, seconds, log)
  report = None
  for line in message.decode(errors='replace').splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and row.get('nonce') == nonce:
      report = row
  if code != 0 or report is None:
    return Outcome('crash', 0, total, seconds, f'exit {code}: {log}')
  results = report.get('tests') or []
  if report.get('solution') != 'pass':
    return Outcome('ok', 0, total, seconds, f'solution: {report.get("solution")}')
  passed = sum(r == 'pass' for r in results[:total])
  return Outcome('ok', passed, total, seconds, ','.join(map(str, results)))


class Scorer:
  """Runs programs in parallel sandboxes (a pool of threads, each waiting on its subprocess:
  the work is in the children) and counts the outcomes.

  `submit` returns a future so a caller can score one rollout while the accelerator generates
  the next; `run` scores a batch and waits."""

  def __init__(self, limits: Limits = Limits(), workers: int = 0):
    self.limits = limits
    self.workers = workers or max(2, os.cpu_count() or 2)
    self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, 'sandbox')
    self.counts = {name: 0 for name in OUTCOMES}
    self._lock = threading.Lock()
    self.sandbox_s = 0.0

  def submit(self, programs: list[Program]) -> concurrent.futures.Future:
    futures = [self._pool.submit(run_program, p, self.limits) for p in programs]
    done: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(futures)]

    def gather(_):
      with self._lock:
        left[0] -= 1
        if left[0]:
          return
        outcomes = [f.result() for f in futures]
        for o in outcomes:
          self.counts[o.status] += 1
          self.sandbox_s += o.seconds
      done.set_result(outcomes)

    for f in futures:
      f.add_done_callback(gather)
    if not futures:
      done.set_result([])
    return done

  def run(self, programs: list[Program]) -> list[Outcome]:
    return self.submit(programs).result()

  def close(self) -> None:
    self._pool.shutdown(wait=True)
