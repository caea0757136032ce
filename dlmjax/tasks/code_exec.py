"""Executed-code rewards: a completion and its tests run in a sandboxed subprocess.

What is enforced, per program (docs/evaluation.md, Code sandbox):
  boundary   the operating system's (sandbox_boundary.py, bubblewrap): a read-only root with only
             the interpreter and the system libraries, a private size-limited /tmp as the only
             writable place, an unprivileged uid, its own PID and network namespaces; inside,
             no_new_privs and a seccomp filter refusing exec (sandbox_child.py). Where the
             machine offers none, programs are refused unless the caller opts in
             (allow_unsandboxed: rl.allow_unsandboxed_code, evaluate's --allow-unsandboxed-code)
  process    a fresh `python -I -S -B` (isolated: no site-packages, no user env, no .pyc) with a
             minimal environment, in its own session (the whole group is killed at the end)
  time       wall clock (the parent kills the group) and RLIMIT_CPU
  memory     RLIMIT_AS; a MemoryError anywhere ends the program as 'memory'
  files      RLIMIT_FSIZE, RLIMIT_NOFILE, the scratch tmpfs's size; an audit hook
             (sys.addaudithook) refuses writing, deleting, renaming or listing outside the
             directory and reading outside it and the interpreter's own library directories
  network    the audit hook refuses any socket.* event (and the namespace has no network)
  processes  the hook refuses fork, exec, spawn, system, subprocess and kill; RLIMIT_NPROC too,
             ctypes is refused (it could call around the hook)
The audit hook is a tripwire that names what a program tried (an outcome per kind); it is no
boundary against code written to defeat it (CPython's docs say as much): the OS boundary is.
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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from dlmjax.tasks import sandbox_boundary, sandbox_child

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
  scratch_mb: int = 64  # the private /tmp inside the boundary: all the program may write


class SandboxUnavailable(ValueError):
  """No OS boundary on this machine, and the caller did not opt in to running without one."""


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


# Inside a boundary, with the audit hook off (this is what the OS alone must hold): not root, in
# its scratch, no_new_privs and a seccomp filter on, / read-only, no network device but loopback,
# no fork (RLIMIT_NPROC), and exec refused by the kernel.
_PROBE = """import os, socket
uid, cwd = os.getuid(), os.getcwd()
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
filtered = status['Seccomp'].strip() == '2' and status['NoNewPrivs'].strip() == '1'
devices = [name for _, name in socket.if_nameindex()]
try:
  open('/usr/dlmjax-probe', 'w')
  read_only = False
except OSError:
  read_only = True
try:
  os.fork() or os._exit(0)
  forks = True
except OSError:
  forks = False
try:
  os.execv('/bin/true', ['true'])
except PermissionError:
  exec_refused = True
"""
_PROBE_TEST = (
  'assert uid != 0 and cwd == "/tmp" and filtered and devices == ["lo"] and read_only '
  'and not forks and exec_refused'
)


@functools.cache
def boundary() -> tuple[sandbox_boundary.Boundary | None, str]:
  """(the OS boundary programs run in, or None; one line saying which, or why there is none).

  Each candidate runs a probe program that must score 1 inside it (sandbox_child.py refuses to
  run when any part fails to hold); the first that does is used for the process's lifetime."""
  found, reasons = sandbox_boundary.candidates()
  probe = Program(_PROBE, (_PROBE_TEST,))
  for candidate in found:
    outcome = _run(probe, Limits(wall_s=30, cpu_s=10), candidate, audit_hook=False)
    if outcome.reward == 1.0:
      return candidate, f'code sandbox: {candidate.name}'
    reasons.append(
      f'{candidate.name}: {outcome.status} ({outcome.detail[-160:]}); needs {candidate.needs}'
    )
  return None, 'code sandbox: NO operating-system boundary (' + '; '.join(reasons) + ')'


def require_boundary(allow_unsandboxed: bool = False) -> str:
  """The start-up line; raises SandboxUnavailable where there is no boundary and no opt-in."""
  found, line = boundary()
  if found is not None:
    return line
  if not allow_unsandboxed:
    raise SandboxUnavailable(
      f'{line}: model-written code is not run without one. Install bubblewrap (apt-get install '
      'bubblewrap) on a machine that allows namespaces, or opt in to the audit hook and rlimits '
      'alone with --config.rl.allow_unsandboxed_code=True (evaluate: --allow-unsandboxed-code).'
    )
  return f'{line}; running programs behind the audit hook and rlimits alone (opted in)'


@functools.cache
def network_isolation() -> tuple[str, ...]:
  """With no OS boundary (opted in): the command prefix that gives a child no network:
  ('unshare', '-n'), '-rn', or ()."""
  unshare = shutil.which('unshare')
  for flags in ('-n', '-rn'):
    if unshare and subprocess.run([unshare, flags, 'true'], capture_output=True).returncode == 0:
      return (unshare, flags)
  return ()


def run_program(
  program: Program, limits: Limits = Limits(), *, allow_unsandboxed: bool = False
) -> Outcome:
  """Runs one program in the sandbox; never raises for anything the program does (raises
  SandboxUnavailable, before running anything, where require_boundary does)."""
  require_boundary(allow_unsandboxed)
  return _run(program, limits, boundary()[0])


def _run(
  program: Program, limits: Limits, inside: sandbox_boundary.Boundary | None, audit_hook=True
) -> Outcome:
  start = time.monotonic()
  host_dir = tempfile.mkdtemp(prefix='dlmjax-sandbox-')  # the spec and the log; not the child's
  read_fd, write_fd = os.pipe()
  try:
    nonce = secrets.token_hex(16)
    read_paths = sandbox_boundary.interpreter_roots() + tuple(
      os.path.realpath(p) for p in program.paths
    )
    spec = dict(
      solution=program.solution,
      setup=program.setup,
      tests=list(program.tests),
      nonce=nonce,
      memory_mb=limits.memory_mb,
      cpu_s=max(1, int(limits.cpu_s)),
      file_mb=limits.file_mb,
      read_roots=read_paths,
      paths=list(program.paths),
      boundary=inside is not None,
      user=sandbox_boundary.unprivileged_user(),
      audit_hook=audit_hook,
    )
    spec_path = os.path.join(host_dir, 'spec.json')
    with open(spec_path, 'w') as f:
      json.dump(spec, f)
    if inside is not None:
      work = sandbox_boundary.SCRATCH
      prefix = inside.argv(read_paths + (os.path.realpath(_CHILD),), limits.scratch_mb << 20)
      popen = inside.popen
    else:
      work = os.path.join(host_dir, 'work')
      os.mkdir(work)
      prefix, popen = network_isolation(), {}
    interpreter = sys.executable if inside is None else sandbox_boundary.interpreter()
    command = [*prefix, interpreter, '-I', '-S', '-B', os.path.realpath(_CHILD), str(write_fd)]
    log_path = os.path.join(host_dir, 'output.log')
    with open(log_path, 'wb') as log, open(spec_path, 'rb') as spec_file:
      proc = subprocess.Popen(
        command,
        cwd=work if inside is None else '/',
        stdin=spec_file,
        stdout=log,
        stderr=log,
        pass_fds=(write_fd,),
        start_new_session=True,
        env={'PATH': '/usr/bin:/bin', 'HOME': work, 'TMPDIR': work, 'PYTHONHASHSEED': '0'},
        **popen,
      )
    os.remove(spec_path)
    os.close(write_fd)
    write_fd = -1
    timed_out = not _exited_within(proc, limits.wall_s)
    _kill_group(proc)
    os.set_blocking(read_fd, False)
    message = _read_all(read_fd)
    code = proc.returncode
    if inside is not None and code > 128:  # bwrap exits 128 + the signal that ended its child
      code = 128 - code
    return _outcome(code, timed_out, message, nonce, len(program.tests), _tail(log_path), start)
  finally:
    if write_fd >= 0:
      os.close(write_fd)
    os.close(read_fd)
    shutil.rmtree(host_dir, ignore_errors=True)


def _exited_within(proc: subprocess.Popen, seconds: float) -> bool:
  """Waits for the child to end, up to `seconds`: on its pidfd, woken the moment it exits
  (Popen.wait(timeout) polls with sleeps growing to 50 ms, a child's typical run time)."""
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    try:
      proc.wait(timeout=seconds)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    return bool(select.select([pidfd], [], [], seconds)[0])
  finally:
    os.close(pidfd)


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
  if code == sandbox_child.BOUNDARY_FAILED:
    return Outcome('crash', 0, total, seconds, log)
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
  the next; `run` scores a batch and waits. Made where there is no OS boundary, it raises
  SandboxUnavailable unless allow_unsandboxed (require_boundary); `sandbox` is its line."""

  def __init__(self, limits: Limits = Limits(), workers: int = 0, allow_unsandboxed=False):
    self.sandbox = require_boundary(allow_unsandboxed)
    self._boundary = boundary()[0]
    self.limits = limits
    self.workers = workers or max(2, os.cpu_count() or 2)
    self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, 'sandbox')
    self.counts = {name: 0 for name in OUTCOMES}
    self._lock = threading.Lock()
    self.sandbox_s = 0.0

  def submit(self, programs: list[Program]) -> concurrent.futures.Future:
    futures = [self._pool.submit(_run, p, self.limits, self._boundary) for p in programs]
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
