"""The child side of the code sandbox (dlmjax/tasks/code_exec.py): run as a script, stdlib only.

  python -I -S sandbox_child.py SPEC.json RESULT_FD

It reads the spec (solution source, setup and test snippets, limits, a nonce) and deletes it,
sets the resource limits, arms an audit hook, then runs the solution and each test in order.
Per-test results go to RESULT_FD as one JSON line tagged with the nonce. Anything the hook
refuses ends the process at once with a code that names the kind (os._exit: no handler of the
completion's can catch it), so a refused operation never half-happens and never goes uncounted.
"""

import json
import os
import resource
import sys

EXIT_CODES = {'network': 81, 'filesystem': 82, 'process': 83, 'native': 84, 'memory': 85}
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
  spec_path, fd = sys.argv[1], int(sys.argv[2])
  with open(spec_path) as f:
    spec = json.load(f)
  os.remove(spec_path)
  del sys.argv[1:]
  nonce, tests = spec['nonce'], spec['tests']
  work_dir = os.path.realpath(os.getcwd())
  sys.path.insert(0, work_dir)
  sys.path.extend(spec['paths'])
  with open(os.path.join(work_dir, 'solution.py'), 'w') as f:
    f.write(spec['solution'])
  import traceback  # noqa: F401  # loaded before the hook: tracebacks read stdlib files

  _limits(spec)
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
