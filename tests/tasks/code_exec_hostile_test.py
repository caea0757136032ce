"""Hostile programs against the code sandbox's OS boundary (docs/evaluation.md, Code sandbox).

Each program tries one way out with a harmless effect the test can see from outside: a marker
file in a world-writable directory, a connection to a Unix socket there, SIGURG (ignored by
default) to the parent or its group, a process left running, bytes written past the scratch
size, the parent's environment read back. Each must end refused or failed (reward 0), nothing
outside may change, and the scorer goes on scoring the next programs. The programs run together
in one parallel batch. Where the machine has no OS boundary these are skipped (the refusal to run
is tested in code_exec_test.py).
"""

import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading

import pytest

from dlmjax.tasks import code_exec as ce

LIMITS = ce.Limits(wall_s=2.5, cpu_s=1, memory_mb=256, scratch_mb=16)
TOKEN = 'dlmjax-hostile-' + secrets.token_hex(4)  # in the command line of any process let loose
# subprocess raises its audit event from Python (sys.audit): a program that replaces sys.audit
# reaches _posixsubprocess.fork_exec, which raises none, and starts any program it likes.
UNAUDITED = 'import os, subprocess, sys\nsys.audit = lambda *a: None\n'
# name: (the program, with {outside}, {token}, this process's id and group filled in; the outcomes
# it may end in)
HOSTILE = {
  'fork_exec_shell': (
    UNAUDITED + 'subprocess.run(["/bin/sh", "-c", "echo x > {outside}/shell"])\n',
    ('ok', 'process'),
  ),
  'fork_exec_python': (  # a second interpreter has no audit hook: it writes where it likes
    UNAUDITED + 'subprocess.run([sys.executable, "-c", "open(\'{outside}/python\', \'w\')"])\n',
    ('ok', 'process'),
  ),
  'sqlite_outside': (
    'import sqlite3\nsqlite3.connect("{outside}/db").execute("create table t(x)")\n',
    ('ok',),
  ),
  'sqlite_dev_shm': (
    'import sqlite3\nsqlite3.connect("/dev/shm/{token}").execute("create table t(x)")\n',
    ('ok',),
  ),
  'fork': ('import os\nif os.fork() == 0:\n  open("{outside}/fork", "w")\n', ('process',)),
  'fork_exec_preexec': (  # fork below subprocess, Python code in the forked child
    UNAUDITED + 'subprocess.run(["/nonexistent"], preexec_fn=lambda: open("{outside}/pre", "w"))\n',
    ('ok', 'filesystem', 'process'),
  ),
  'ctypes_open': (
    'import ctypes\nctypes.CDLL(None).open(b"{outside}/ctypes", 0o101, 0o644)\n',
    ('native',),
  ),
  'parent_environ': (  # the parent's environment and command line, read through /proc
    UNAUDITED + 'ppid = os.getppid()\n'
    'out = subprocess.run(["cat", f"/proc/{{ppid}}/environ", f"/proc/{{ppid}}/cmdline"],'
    ' capture_output=True).stdout\n'
    'names = {{v.split(b"=")[0].decode() for v in out.split(b"\\0") if b"=" in v}}\n'
    'escaped = bool(names - set(os.environ))\n',
    ('ok', 'process'),
  ),
  'signal_parent': (  # pidfd_send_signal raises no audit event
    'import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({parent}), signal.SIGURG)\n',
    ('ok',),
  ),
  'signal_parent_group': (
    UNAUDITED + 'subprocess.run(["kill", "-URG", "--", "-{group}"], check=True)\n',
    ('ok', 'process'),
  ),
  'sleeper_left_behind': (  # a new session survives the kill of the program's group
    UNAUDITED
    + 'subprocess.Popen(["/bin/sh", "-c", "sleep 30; : {token}"], start_new_session=True)\n',
    ('ok', 'process'),
  ),
  'fill_disk': (  # 4x the scratch size, in files under RLIMIT_FSIZE
    'written = 0\n'
    'try:\n'
    '  for i in range(64):\n'
    '    with open(f"fill{{i}}", "wb") as f:\n'
    '      written += f.write(bytes(1 << 20))\n'
    'except OSError:\n'
    '  pass\n'
    'escaped = written >= 64 << 20\n',
    ('ok',),
  ),
  'exhaust_fds': (
    'import os\nfds = []\ntry:\n  while len(fds) < 4096:\n    fds += os.pipe()\n'
    'except OSError:\n  pass\nescaped = len(fds) >= 4096\n',
    ('ok',),
  ),
  'exhaust_memory': ('x = []\nwhile True:\n  x.append(bytearray(10**9))\n', ('memory',)),
  'sleep_past_wall': ('import time\ntime.sleep(60)\n', ('timeout',)),
  'network_unix_socket': (  # a socket in the shared filesystem crosses network namespaces
    UNAUDITED + 'subprocess.run([sys.executable, "-c", "import socket; '
    "s = socket.socket(socket.AF_UNIX); s.connect('{outside}/sock'); s.send(b'x')\"])\n",
    ('ok', 'process'),
  ),
  'network_tcp': (
    'import socket\nsocket.create_connection(("1.1.1.1", 80), timeout=1)\n',
    ('network',),
  ),
}


@pytest.fixture(scope='module')
def outside():
  """A world-writable directory outside the sandbox, a listening Unix socket in it, and a
  SIGURG counter in this process."""
  if ce.boundary()[0] is None:
    pytest.skip(ce.boundary()[1])
  path = tempfile.mkdtemp(prefix='dlmjax-hostile-', dir='/tmp')
  os.chmod(path, 0o777)
  server = socket.socket(socket.AF_UNIX)
  server.bind(os.path.join(path, 'sock'))
  os.chmod(os.path.join(path, 'sock'), 0o777)
  server.listen(4)
  server.settimeout(0.2)
  connections, signals, stop = [], [], threading.Event()

  def accept():
    while not stop.is_set():
      try:
        connections.append(server.accept()[0])
      except OSError:
        pass

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  previous = signal.signal(signal.SIGURG, lambda *_: signals.append(1))
  try:
    yield dict(path=path, connections=connections, signals=signals)
  finally:
    signal.signal(signal.SIGURG, previous)
    stop.set()
    thread.join()
    server.close()
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(f'/dev/shm/{TOKEN}'):
      os.remove(f'/dev/shm/{TOKEN}')


def _let_loose() -> list[int]:
  """Processes whose command line holds TOKEN (ended here, so none outlives the test)."""
  found = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        if TOKEN.encode() in f.read():
          found.append(int(pid))
    except OSError:
      continue
  for pid in found:
    os.kill(pid, signal.SIGKILL)
  return found


@pytest.fixture(scope='module')
def hostile(outside):
  scorer = ce.Scorer(LIMITS, workers=4)
  names = sorted(HOSTILE)
  fill = dict(outside=outside['path'], token=TOKEN, parent=os.getpid(), group=os.getpgid(0))
  programs = [ce.Program(HOSTILE[n][0].format(**fill), ('assert escaped',)) for n in names]
  # A program that only says whether it got out: `escaped` set means it did.
  for i, name in enumerate(names):
    if 'escaped' not in programs[i].solution:
      programs[i] = ce.Program(programs[i].solution + 'escaped = True\n', ('assert escaped',))
  outcomes = dict(zip(names, scorer.run(programs)))
  after = scorer.run([ce.Program('def f():\n  return 2\n', ('assert f() == 2',))] * 2)
  scorer.close()
  return outcomes, after, _let_loose()


@pytest.mark.parametrize('name', sorted(HOSTILE))
def test_hostile_program_ends_refused_or_failed(hostile, name):
  outcome = hostile[0][name]
  assert outcome.reward == 0.0 and outcome.verdict != 'passed', outcome.detail
  assert outcome.status in HOSTILE[name][1], outcome.detail


def test_nothing_outside_changed_and_scoring_goes_on(hostile, outside):
  _, after, let_loose = hostile
  assert sorted(os.listdir(outside['path'])) == ['sock']
  assert not os.path.exists(f'/dev/shm/{TOKEN}')
  assert outside['connections'] == []
  assert outside['signals'] == []
  assert let_loose == []
  assert [o.reward for o in after] == [1.0, 1.0]
