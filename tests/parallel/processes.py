"""What the multi-process tests share: the launch variables a child must not inherit, the
compile cache, and a coordinator port held until the processes exit."""

import contextlib
import os
import socket

LAUNCH_VARS = (
  'COORDINATOR_ADDRESS',
  'NUM_PROCESSES',
  'PROCESS_ID',
  'LOCAL_DEVICE_IDS',
  'LOCAL_RANK',
  'JAX_COORDINATOR_ADDRESS',
  'XLA_FLAGS',
)


def cache_dir(tmp):
  """$DLMJAX_CACHE_DIR, or a cache in the test's directory."""
  return os.environ.get('DLMJAX_CACHE_DIR') or str(tmp / 'cache')


@contextlib.contextmanager
def reserved_port():
  """A TCP port for JAX's coordinator, held bound until the processes using it have exited.

  Binding port 0, closing and handing the number on races: until process 0 binds it seconds
  later, the kernel may give the same port to any bind(0) or to an outgoing connection (the
  gRPC clients of a concurrent test among them). Here the socket stays bound, not listening,
  so the kernel hands the port to nobody else, while SO_REUSEADDR lets the coordinator's gRPC
  server (which sets SO_REUSEADDR too) bind and listen on it: Linux refuses a shared address
  only when the other socket listens.
  """
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('localhost', 0))
    yield s.getsockname()[1]
