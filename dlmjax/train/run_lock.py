"""One run per output_dir: an exclusive lock on `<output_dir>/.lock`, held for the whole run.

Two runs writing one directory would mix their checkpoints and metrics. The lock is an flock(2)
on the file, which the kernel drops when the process ends in any way (SIGKILL included), so a
dead run never leaves a lock behind on a local disk; the file's text names the holder (pid, host,
start time) for the message. On a filesystem without flock the text alone decides: a holder on
this host that no longer runs is taken over; one on another host is reported with the fix.
Only process 0 locks; every process learns the outcome, so none waits in a collective.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

import jax
import numpy as np

from dlmjax import config as config_lib

LOCK_FILE = '.lock'


class RunDirectoryInUse(config_lib.ConfigError):
  """Another run holds the output_dir's lock."""


class RunLock:
  """Context manager: acquire on enter (or raise RunDirectoryInUse), release on exit."""

  def __init__(self, run_dir: str):
    self.path = os.path.join(os.path.abspath(run_dir), LOCK_FILE)
    self._fd: int | None = None

  def __enter__(self) -> RunLock:
    problem = self._acquire() if jax.process_index() == 0 else None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      failed = multihost_utils.broadcast_one_to_all(np.int32(problem is not None))
      if int(failed) and problem is None:
        problem = f'process 0 found {os.path.dirname(self.path)} in use by another run'
    if problem:
      raise RunDirectoryInUse(problem)
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def _acquire(self) -> str | None:
    """None when this process holds the lock, else the message naming the holder and the fix."""
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        holder = _read_holder(fd)
        os.close(fd)
        return self._message(holder)
      # No flock here (some network filesystems): the holder's text decides.
      holder = _read_holder(fd)
      if holder and not _is_gone(holder) and holder.get('pid') != os.getpid():
        os.close(fd)
        return self._message(holder)
    os.ftruncate(fd, 0)
    os.pwrite(
      fd,
      json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), started=time.time())).encode(),
      0,
    )
    self._fd = fd
    return None

  def _message(self, holder: dict) -> str:
    who = 'another process'
    if holder:
      started = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))
      who = f'pid {holder.get("pid")} on host {holder.get("host")} (started {started})'
    return (
      f'output_dir {os.path.dirname(self.path)} is in use by another run: {who}; two runs in one '
      'directory would mix their checkpoints. Stop that run, or set --config.output_dir to '
      f'another directory; if that run is gone for good (its host died), delete {self.path}.'
    )


def _read_holder(fd: int) -> dict:
  try:
    return json.loads(os.pread(fd, 4096, 0).decode() or '{}')
  except ValueError:
    return {}


def _is_gone(holder: dict) -> bool:
  """Whether the holder named in the file is a process of this host that no longer runs."""
  if holder.get('host') != socket.gethostname():
    return False
  try:
    os.kill(int(holder['pid']), 0)
  except ProcessLookupError:
    return True
  except (OSError, KeyError, ValueError):
    return False
  return False
