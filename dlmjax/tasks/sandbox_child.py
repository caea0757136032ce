"""The child side of the code sandbox (dlmjax/tasks/code_exec.py): run as a script, stdlib only.

  python -I -S sandbox_child.py RESULT_FD < SPEC.json

It reads the spec (solution source, setup and test snippets, limits, a nonce) from stdin, gives
up root for the unprivileged user the spec names (inside the OS boundary: sandbox_boundary.py),
sets no_new_privs and a seccomp filter that refuses exec and the kernel's namespace, mount,
ptrace and io_uring calls, sets the resource limits, arms an audit hook, then runs the solution
and each test in order.
Per-test results go to RESULT_FD as one JSON line tagged with the nonce. Anything the hook
refuses ends the process at once with a code that names the kind (os._exit: no handler of the
completion's can catch it), so a refused operation never half-happens and never goes uncounted.
"""

import json
import os
import resource
import struct
import sys

EXIT_CODES = {'network': 81, 'filesystem': 82, 'process': 83, 'native': 84, 'memory': 85}
BOUNDARY_FAILED = 86  # the spec asked for the OS boundary and it could not be set up: no run
_PROCESS_EVENTS = (
  'os.system',
  'os.exec',
  'os.posix_spawn',
  'os.spawn',
  'os.fork',
  'os.forkpty',
  'subprocess.Popen',
  'os.kill',
  'os.killpg',
  'signal.pthread_kill',
  'sys.addaudithook',
)
_PATH_EVENTS = {  # event -> indices of its path arguments
  'os.remove': (0,),
  'os.rename': (0, 1),
  'os.replace': (0, 1),
  'os.rmdir': (0,),
  'os.mkdir': (0,),
  'os.chmod': (0,),
  'os.chown': (0,),
  'os.link': (0, 1),
  'os.symlink': (0, 1),
  'os.truncate': (0,),
  'os.utime': (0,),
  'os.chdir': (0,),
  'os.chflags': (0,),
  'os.setxattr': (0,),
  'os.removexattr': (0,),
  'shutil.rmtree': (0,),
  'shutil.copyfile': (1,),
  'shutil.move': (1,),
}
_LIST_EVENTS = ('os.listdir', 'os.scandir', 'glob.glob', 'os.walk')
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


# seccomp (the kernel's seccomp_filter documentation; linux/filter.h, linux/seccomp.h): a
# classic BPF program over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}.
_AUDIT_ARCH = {'x86_64': 0xC000003E, 'aarch64': 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64's x32 ABI numbers: refused outright
# Refused with EPERM: starting programs, and the calls that reach kernel attack surface or
# could undo the boundary (namespaces, mounts, tracing other processes, BPF, keys, io_uring,
# whose operations seccomp does not see). clone3 gets ENOSYS: its flags are behind a pointer, and
# glibc falls back to clone. The same numbers for both architectures from 424 on.
_REFUSED_SYSCALLS = {
  'x86_64': dict(
    execve=59,
    execveat=322,
    ptrace=101,
    process_vm_readv=310,
    process_vm_writev=311,
    unshare=272,
    setns=308,
    mount=165,
    umount2=166,
    pivot_root=155,
    chroot=161,
    bpf=321,
    perf_event_open=298,
    userfaultfd=323,
    keyctl=250,
    add_key=248,
    request_key=249,
    open_by_handle_at=304,
    kexec_load=246,
    init_module=175,
    finit_module=313,
  ),
  'aarch64': dict(
    execve=221,
    execveat=281,
    ptrace=117,
    process_vm_readv=270,
    process_vm_writev=271,
    unshare=97,
    setns=268,
    mount=40,
    umount2=39,
    pivot_root=41,
    chroot=51,
    bpf=280,
    perf_event_open=241,
    userfaultfd=282,
    keyctl=219,
    add_key=217,
    request_key=218,
    open_by_handle_at=265,
    kexec_load=104,
    init_module=105,
    finit_module=273,
  ),
}
_COMMON_REFUSED = dict(
  io_uring_setup=425,
  io_uring_enter=426,
  io_uring_register=427,
  open_tree=428,
  move_mount=429,
  fsopen=430,
  fsconfig=431,
  fsmount=432,
  fspick=433,
  mount_setattr=442,
)
_CLONE3 = 435
_EPERM, _ENOSYS = 1, 38


def _seccomp_program(machine: str) -> bytes:
  """The filter: another architecture's calls kill the process, the refused ones fail."""
  ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JGE|K, RET|K
  allow, errno, kill = 0x7FFF0000, 0x00050000, 0x80000000

  def op(code, k, jt=0, jf=0):
    return struct.pack('HBBI', code, jt, jf, k)

  refused = {**_REFUSED_SYSCALLS[machine], **_COMMON_REFUSED}
  prog = [op(ld_abs, 4), op(jeq, _AUDIT_ARCH[machine], 1, 0), op(ret, kill), op(ld_abs, 0)]
  if machine == 'x86_64':
    prog += [op(jge, _X32_BIT, 0, 1), op(ret, kill)]
  for nr in sorted(refused.values()):
    prog += [op(jeq, nr, 0, 1), op(ret, errno | _EPERM)]
  prog += [op(jeq, _CLONE3, 0, 1), op(ret, errno | _ENOSYS), op(ret, allow)]
  return b''.join(prog)


def _no_exec() -> str:
  """no_new_privs and the seccomp filter, through prctl (ctypes, before the hook refuses it);
  '' when set, else why not."""
  machine = os.uname().machine
  if machine not in _AUDIT_ARCH:
    return f'no seccomp filter for {machine}'
  import ctypes  # pylint: disable=import-outside-toplevel

  libc = ctypes.CDLL(None, use_errno=True)
  ulong = ctypes.c_ulong
  pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
  if libc.prctl(pr_set_no_new_privs, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:
    return f'prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}'
  code = _seccomp_program(machine)

  class SockFprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_char_p)]

  prog = SockFprog(len(code) // 8, code)
  failed = libc.prctl(pr_set_seccomp, ulong(seccomp_mode_filter), ctypes.byref(prog), 0, 0)
  error = os.strerror(ctypes.get_errno())
  for name in [m for m in sys.modules if m == 'ctypes' or m.startswith(('ctypes.', '_ctypes'))]:
    del sys.modules[name]  # a program's `import ctypes` loads it again, past the hook
  return f'prctl(PR_SET_SECCOMP): {error}' if failed else ''


def _drop_root(uid: int, gid: int) -> str:
  """Root becomes the unprivileged user (its capabilities go with the uid); '' or why not."""
  try:
    if os.getuid() == 0 or os.geteuid() == 0:
      os.setgroups([])
      os.setresgid(gid, gid, gid)
      os.setresuid(uid, uid, uid)
  except OSError as e:
    return f'dropping root for uid {uid}: {e}'
  if 0 in (os.getuid(), os.geteuid(), *os.getresuid()):
    return 'still root'
  return ''


def _boundary_failed(detail: str) -> None:
  os.write(2, f'\nsandbox boundary failed: {detail}\n'.encode(errors='replace'))
  os._exit(BOUNDARY_FAILED)


def _die(kind: str, detail: str) -> None:
  try:
    os.write(2, f'\nsandbox refused ({kind}): {detail}\n'.encode(errors='replace')[:2000])
  finally:
    os._exit(EXIT_CODES[kind])


def _make_hook(work_dir: str, read_roots: tuple):
  realpath, fspath = os.path.realpath, os.fspath

  def inside(path, roots) -> bool:
    if isinstance(path, int):
      return True  # an fd the process already holds
    try:
      real = realpath(fspath(path) if not isinstance(path, bytes) else path.decode())
    except (TypeError, ValueError):
      return False
    return any(real == root or real.startswith(root + os.sep) for root in roots)

  write_roots = (work_dir,)
  readable = (work_dir, *read_roots)

  def hook(event, args):
    if event.startswith('socket.'):
      _die('network', event)
    if event.startswith('ctypes.') or event == 'cpython.run_command':
      _die('native', event)
    if event in _PROCESS_EVENTS:
      _die('process', event)
    if event == 'open':
      path, mode, flags = args
      writes = (mode is not None and any(c in mode for c in 'wax+')) or (
        mode is None and flags & _WRITE_FLAGS
      )
      if not inside(path, write_roots if writes else readable):
        _die('filesystem', f'open {path!r} mode={mode or flags}')
    elif event in _PATH_EVENTS:
      for i in _PATH_EVENTS[event]:
        if i < len(args) and args[i] is not None and not inside(args[i], write_roots):
          _die('filesystem', f'{event} {args[i]!r}')
    elif event in _LIST_EVENTS:
      if args and args[0] is not None and not inside(args[0], readable):
        _die('filesystem', f'{event} {args[0]!r}')

  return hook


def _limits(spec: dict) -> None:
  mb = 1 << 20
  resource.setrlimit(resource.RLIMIT_AS, (spec['memory_mb'] * mb,) * 2)
  resource.setrlimit(resource.RLIMIT_CPU, (spec['cpu_s'], spec['cpu_s'] + 1))
  resource.setrlimit(resource.RLIMIT_FSIZE, (spec['file_mb'] * mb,) * 2)
  resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # not enforced for root: the hook is
  except (ValueError, OSError):
    pass


def main() -> None:
  fd = int(sys.argv[1])
  with os.fdopen(0, closefd=False) as f:
    spec = json.load(f)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  del sys.argv[1:]
  if spec['boundary']:  # inside the OS boundary: it must all hold, or nothing runs
    failed = _drop_root(*spec['user']) or _no_exec()
    if failed:
      _boundary_failed(failed)
  else:
    _no_exec()  # best effort with no boundary: exec refused where the kernel allows a filter
  nonce, tests = spec['nonce'], spec['tests']
  work_dir = os.path.realpath(os.getcwd())
  sys.path.insert(0, work_dir)
  sys.path.extend(spec['paths'])
  with open(os.path.join(work_dir, 'solution.py'), 'w') as f:
    f.write(spec['solution'])
  import traceback  # noqa: F401  # loaded before the hook: tracebacks read stdlib files

  _limits(spec)
  if spec['audit_hook']:  # off only for code_exec's probe of the boundary (trusted code)
    sys.addaudithook(_make_hook(work_dir, tuple(os.path.realpath(p) for p in spec['read_roots'])))
  results = []

  def run(source: str, namespace: dict, name: str):
    try:
      exec(compile(source, name, 'exec'), namespace)  # noqa: S102  # the point of a sandbox
      return 'pass'
    except MemoryError:
      _die('memory', name)
    except AssertionError:
      return 'fail'
    except SyntaxError:
      return 'syntax'
    except BaseException as e:  # noqa: BLE001  # SystemExit and KeyboardInterrupt too
      return type(e).__name__

  namespace = {'__name__': '__main__'}
  outcome = run(spec['solution'], namespace, 'solution.py')
  if outcome == 'pass':
    outcome = run(spec['setup'], namespace, 'setup.py') if spec['setup'] else 'pass'
    if outcome == 'pass':
      results = [run(test, namespace, f'test_{i}.py') for i, test in enumerate(tests)]
    else:
      outcome = f'setup:{outcome}'
  line = json.dumps({'nonce': nonce, 'solution': outcome, 'tests': results}) + '\n'
  os.write(fd, line.encode())
  os._exit(0)  # skips atexit handlers the completion may have registered


if __name__ == '__main__':
  main()
