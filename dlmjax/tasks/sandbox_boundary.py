"""The operating-system boundary around a sandboxed program: bubblewrap (`bwrap`).

bubblewrap is the well-kept unprivileged sandbox tool (Flatpak's): it builds the child's mount,
PID, network, IPC and UTS namespaces from a command line, and its flags say what the child sees.
What every boundary here gives the child (docs/evaluation.md, Code sandbox):
  filesystem  a fresh root holding, read-only, only /usr (and /bin, /lib* beside it), the
              dynamic loader's cache, the interpreter's prefix and the directories a program may
              import from; a private, size-limited tmpfs /tmp as its scratch and working
              directory; its own /proc (its own processes only) and a minimal /dev
  user        an unprivileged uid: root's child gives up root for `nobody` before any program
              code runs (sandbox_child.py); a non-root caller's child keeps the caller's uid
  network     a network namespace of its own: only a loopback device, nothing outside
  processes   its own PID namespace (the parent and its group are not there to signal), killed
              whole when bwrap dies (--die-with-parent); exec is refused by the child's seccomp
              filter and forking by RLIMIT_NPROC, both set before any program code runs
A boundary is one entry of CANDIDATES, tried in order: the first that runs a probe program
(code_exec.boundary) is used.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig

SCRATCH = '/tmp'  # the child's working directory inside a boundary (a tmpfs of its own)
_TOP_LEVEL = ('/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
_LOADER_FILES = ('/etc/ld.so.cache', '/etc/ld.so.conf')


@dataclasses.dataclass(frozen=True)
class Boundary:
  """How to start a child inside the boundary: argv(read paths, scratch bytes) is the command
  prefix before the interpreter; popen holds Popen's user/group switch, if any."""

  name: str
  argv: object  # Callable[[tuple[str, ...], int], list[str]]
  popen: dict = dataclasses.field(default_factory=dict)
  needs: str = ''  # what the machine must allow, for the line that says none was usable


@functools.cache
def unprivileged_user() -> tuple[int, int]:
  """(uid, gid) of `nobody` (65534 where the passwd file lacks it): who root's child becomes."""
  try:
    entry = pwd.getpwnam('nobody')
    return entry.pw_uid, entry.pw_gid
  except KeyError:
    return 65534, 65534


def interpreter() -> str:
  """The interpreter the child runs: the real file (a venv's python is a symlink, and its
  pyvenv.cfg would point the child at site-packages it must not see)."""
  return os.path.realpath(sys.executable)


@functools.cache
def interpreter_roots() -> tuple[str, ...]:
  """The directories the interpreter needs: its prefix (stdlib, extension modules, libpython)."""
  paths = sysconfig.get_paths()
  roots = {sys.base_prefix, sys.base_exec_prefix, paths['stdlib'], paths['platstdlib']}
  roots.add(os.path.dirname(os.path.dirname(interpreter())))
  return tuple(sorted(os.path.realpath(p) for p in roots if p))


def _bwrap_argv(bwrap: str, as_root: bool, read_paths, scratch_bytes: int) -> list[str]:
  argv = [bwrap, '--die-with-parent', '--unshare-pid', '--unshare-net', '--unshare-ipc']
  argv += ['--unshare-uts', '--unshare-cgroup-try']
  if as_root:  # only what the child needs to become nobody; the uid switch clears these too
    argv += ['--cap-drop', 'ALL', '--cap-add', 'CAP_SETUID', '--cap-add', 'CAP_SETGID']
  else:
    argv += ['--unshare-user']
  for top in _TOP_LEVEL:
    if os.path.islink(top):
      argv += ['--symlink', os.readlink(top), top]
    elif os.path.isdir(top):
      argv += ['--ro-bind', top, top]
  # The scratch first: a read path under /tmp (a checkout or an interpreter there) is bound
  # into it after, not hidden beneath it.
  argv += ['--size', str(scratch_bytes), '--perms', '1777', '--tmpfs', SCRATCH]
  bound, made = [], {SCRATCH}
  for path in sorted({'/usr', *(os.path.realpath(p) for p in read_paths)}, key=len):
    if any(path == b or path.startswith(b.rstrip('/') + '/') for b in (*bound, *_TOP_LEVEL)):
      continue  # inside a directory already there
    parent = os.path.dirname(path)
    chain = []
    while parent not in ('/', '') and parent not in made:
      chain.append(parent)
      parent = os.path.dirname(parent)
    for d in reversed(chain):  # bwrap would make them 0700 as their owner: others cannot pass
      argv += ['--perms', '0755', '--dir', d]
      made.add(d)
    argv += ['--ro-bind', path, path]
    bound.append(path)
  for path in _LOADER_FILES:
    argv += ['--ro-bind-try', path, path]
  argv += ['--proc', '/proc', '--dev', '/dev']
  argv += ['--chdir', SCRATCH]
  return argv


def candidates() -> tuple[list[Boundary], list[str]]:
  """(the boundaries this machine might offer, in order of preference; why others are out)."""
  bwrap = shutil.which('bwrap')
  if not bwrap:
    return [], ['bubblewrap is not installed (apt-get install bubblewrap)']
  version = subprocess.run([bwrap, '--version'], capture_output=True, text=True).stdout.strip()
  found = []
  if os.geteuid() == 0:
    uid, gid = unprivileged_user()
    found.append(
      Boundary(
        f'{version}, the program as uid {uid} (root gives up root in the child)',
        functools.partial(_bwrap_argv, bwrap, True),
        needs='namespaces for root (CAP_SYS_ADMIN)',
      )
    )
    # Where root may not make namespaces (a container) but users may: bwrap as nobody, in a
    # user namespace. Needs the interpreter somewhere nobody can read.
    found.append(
      Boundary(
        f'{version} in a user namespace, started as uid {uid}',
        functools.partial(_bwrap_argv, bwrap, False),
        popen=dict(user=uid, group=gid, extra_groups=[]),
        needs=f'user namespaces for uid {uid}, and the interpreter readable by it',
      )
    )
  else:
    found.append(
      Boundary(
        f'{version} in a user namespace, as uid {os.geteuid()}',
        functools.partial(_bwrap_argv, bwrap, False),
        needs='user namespaces',
      )
    )
  return found, []
