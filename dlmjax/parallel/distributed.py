"""Multi-host start-up: one `jax.distributed.initialize` from whatever launched this process.

Every process of a job runs the same program; this module works out, from the environment alone,
how many processes there are, which one this is, where process 0 listens and which local GPUs
this process drives. Sources, the first one present wins:

1. explicit: COORDINATOR_ADDRESS=host:port, NUM_PROCESSES, PROCESS_ID [, LOCAL_DEVICE_IDS=0,1]
2. MegaDLMs' envs/.env: MASTER_ADDR, MASTER_PORT, NUM_NODES, NODE_RANK; one process per node,
   or one per GPU when the launcher sets LOCAL_RANK (then GPUS_PER_NODE is needed too)
3. SLURM (inside `srun`): SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
   SLURM_LOCALID; the coordinator is the step's first node, the port JAX_COORDINATOR_PORT or
   61440 + job id % 4096 (JAX's choice). One task per node drives all the node's GPUs; several
   tasks per node drive one GPU each (JAX's own detection would pin even a lone task to GPU 0).

None of them: a single process, and nothing is initialised. LOCAL_DEVICE_IDS overrides the
devices of any source. HEARTBEAT_TIMEOUT_S (default 30) is how long a process may go without a
heartbeat before JAX's coordination service declares it dead and stops the others (JAX's own
default is 100 s; docs/faults.md, A process of a multi-process run dies). An environment that
contradicts itself fails with the variable to fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from dlmjax import config as config_lib

_EXPLICIT = ('COORDINATOR_ADDRESS', 'NUM_PROCESSES', 'PROCESS_ID')
_MEGADLMS = ('MASTER_ADDR', 'MASTER_PORT', 'NUM_NODES', 'NODE_RANK')
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
HEARTBEAT_TIMEOUT_S = 30  # seconds without a heartbeat before a process counts as dead


class LaunchError(config_lib.ConfigError):
  """The launch environment is incomplete or inconsistent; the message names the variable."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """Where this process sits in the job. local_device_ids None: every local device."""

  source: str  # explicit | megadlms | slurm | single
  num_processes: int = 1
  process_id: int = 0
  coordinator_address: str | None = None
  local_device_ids: tuple[int, ...] | None = None
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

  @property
  def is_multiprocess(self) -> bool:
    return self.num_processes > 1


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
  """The Launch the environment describes (pure: reads `env`, starts nothing)."""
  env = os.environ if env is None else env
  if any(_set(env, k) for k in _EXPLICIT):
    launch = _explicit(env)
  elif any(_set(env, k) for k in _MEGADLMS):
    launch = _megadlms(env)
  elif all(_set(env, k) for k in _SLURM):
    launch = _slurm(env)
  else:
    launch = Launch('single')
  if _set(env, 'LOCAL_DEVICE_IDS'):
    ids = tuple(_int(env, 'LOCAL_DEVICE_IDS', part) for part in env['LOCAL_DEVICE_IDS'].split(','))
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
      raise LaunchError(
        f'LOCAL_DEVICE_IDS={env["LOCAL_DEVICE_IDS"]!r} must list distinct '
        'device ids >= 0, e.g. 0,1,2,3.'
      )
    launch = dataclasses.replace(launch, local_device_ids=ids)
  if _set(env, 'HEARTBEAT_TIMEOUT_S'):
    timeout = _int(env, 'HEARTBEAT_TIMEOUT_S')
    if timeout < 1:
      raise LaunchError(
        f'HEARTBEAT_TIMEOUT_S={timeout} must be >= 1 (seconds without a heartbeat before a '
        f'process counts as dead; default {HEARTBEAT_TIMEOUT_S}).'
      )
    launch = dataclasses.replace(launch, heartbeat_timeout_s=timeout)
  if launch.source not in ('slurm', 'single') and all(_set(env, k) for k in _SLURM):
    _check_against_slurm(launch, env)
  return launch


_initialized: Launch | None = None


def initialize(env: Mapping[str, str] | None = None) -> Launch:
  """Reads the launch environment and, for several processes, connects them (once).

  Call before anything touches a JAX device: the backends are created on first use with the
  devices and collectives of the job.
  """
  global _initialized  # pylint: disable=global-statement
  if _initialized is not None:
    return _initialized
  launch = launch_from_env(env)
  if launch.is_multiprocess:
    import jax  # pylint: disable=import-outside-toplevel

    jax.distributed.initialize(
      coordinator_address=launch.coordinator_address,
      num_processes=launch.num_processes,
      process_id=launch.process_id,
      local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
      # We detected the cluster ourselves; JAX's detection would override local devices.
      cluster_detection_method='deactivate',
      # A dead peer ends the others after this long (also the bound on the shutdown barrier
      # a survivor waits in), not after JAX's 100 s.
      heartbeat_timeout_seconds=launch.heartbeat_timeout_s,
    )
  _initialized = launch
  return launch


# ----------------------------------------------------------------------------------------------
# Sources


def _check_rank(rank_name: str, rank: int, count_name: str, count: int, hint: str) -> None:
  """A count of at least 1 and a rank inside it, each named as the environment names it."""
  if count < 1:
    raise LaunchError(f'{count_name}={count} must be >= 1.')
  if not 0 <= rank < count:
    raise LaunchError(f'{rank_name}={rank} must be in [0, {count_name}={count}){hint}')


def _explicit(env) -> Launch:
  _require(env, _EXPLICIT, 'explicit launch')
  address = env['COORDINATOR_ADDRESS']
  _check_address(address, 'COORDINATOR_ADDRESS')
  num = _int(env, 'NUM_PROCESSES')
  pid = _int(env, 'PROCESS_ID')
  _check_rank('PROCESS_ID', pid, 'NUM_PROCESSES', num, '; number the processes 0..NUM_PROCESSES-1.')
  return Launch('explicit', num, pid, address)


def _megadlms(env) -> Launch:
  _require(env, _MEGADLMS, 'MegaDLMs-style launch (envs/.env)')
  nodes, rank = _int(env, 'NUM_NODES'), _int(env, 'NODE_RANK')
  port = _int(env, 'MASTER_PORT')
  _check_rank(
    'NODE_RANK', rank, 'NUM_NODES', nodes, '; give each node its own rank 0..NUM_NODES-1.'
  )
  if not 0 < port < 65536:
    raise LaunchError(f'MASTER_PORT={port} is not a TCP port (1..65535).')
  address = f'{env["MASTER_ADDR"]}:{port}'
  if not _set(env, 'LOCAL_RANK'):
    return Launch('megadlms', nodes, rank, address)
  # One process per GPU: the launcher numbers the processes of a node with LOCAL_RANK.
  _require(env, ('GPUS_PER_NODE',), 'one process per GPU (LOCAL_RANK is set)')
  per_node, local = _int(env, 'GPUS_PER_NODE'), _int(env, 'LOCAL_RANK')
  _check_rank('LOCAL_RANK', local, 'GPUS_PER_NODE', per_node, '.')
  return Launch('megadlms', nodes * per_node, rank * per_node + local, address, (local,))


def _slurm(env) -> Launch:
  num, pid = _int(env, 'SLURM_NTASKS'), _int(env, 'SLURM_PROCID')
  if num == 1:
    return Launch('single')
  if not 0 <= pid < num:
    raise LaunchError(f'SLURM_PROCID={pid} is not below SLURM_NTASKS={num}.')
  port = (
    _int(env, 'JAX_COORDINATOR_PORT')
    if _set(env, 'JAX_COORDINATOR_PORT')
    else 61440 + _int(env, 'SLURM_JOB_ID') % 4096
  )
  address = f'{first_hostname(env["SLURM_STEP_NODELIST"])}:{port}'
  nodes = _int(env, 'SLURM_STEP_NUM_NODES') if _set(env, 'SLURM_STEP_NUM_NODES') else None
  if nodes is not None and num == nodes:
    return Launch('slurm', num, pid, address)  # one task per node: all its GPUs
  if len(env.get('CUDA_VISIBLE_DEVICES', '').split(',')) == 1 and env.get('CUDA_VISIBLE_DEVICES'):
    return Launch('slurm', num, pid, address)  # srun already bound one GPU to the task
  return Launch('slurm', num, pid, address, (_int(env, 'SLURM_LOCALID'),))


def first_hostname(nodelist: str) -> str:
  """The first host of a SLURM node list: 'gpu[003-010,012],cpu1' -> 'gpu003'."""
  nodelist = nodelist.strip()
  cut = min([i for i in (nodelist.find(','), nodelist.find('[')) if i >= 0] or [len(nodelist)])
  if cut == len(nodelist) or nodelist[cut] == ',':
    return nodelist[:cut]
  return nodelist[:cut] + re.split(r'[,\-\]]', nodelist[cut + 1 :], maxsplit=1)[0]


def _check_against_slurm(launch: Launch, env) -> None:
  """Under srun, each SLURM task is one of our processes or launches an equal share of them."""
  tasks = _int(env, 'SLURM_NTASKS')
  if launch.num_processes % tasks:
    names = ' / '.join(_EXPLICIT if launch.source == 'explicit' else _MEGADLMS)
    raise LaunchError(
      f'{names} describe {launch.num_processes} process(es), but SLURM started '
      f'{tasks} tasks, each of which runs or launches an equal share of them; fix '
      'the variables (e.g. NUM_NODES=$SLURM_NNODES), or unset them to let SLURM '
      'decide.'
    )


# ----------------------------------------------------------------------------------------------
# Parsing


def _set(env, key) -> bool:
  return bool(env.get(key, '').strip())


def _require(env, keys, what) -> None:
  missing = [k for k in keys if not _set(env, k)]
  if missing:
    given = [k for k in keys if _set(env, k)]
    raise LaunchError(
      f'{what} needs {", ".join(keys)}; {", ".join(given)} set but '
      f'{", ".join(missing)} missing. Set them all (see envs/.env.example), or '
      'unset them all for a single process.'
    )


def _int(env, key, text=None) -> int:
  text = env[key] if text is None else text
  try:
    return int(text.strip())
  except ValueError:
    raise LaunchError(f'{key}={env[key]!r} is not an integer.') from None


def _check_address(address, key) -> None:
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise LaunchError(f'{key}={address!r} is not host:port (e.g. 10.0.0.1:61440).')


# ----------------------------------------------------------------------------------------------
# Running as one of several processes


def barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process arrives, through the coordination service (no device collective,
  so no collective timeout: gloo's is 30 s). A no-op for one process."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return
  from orbax.checkpoint import multihost  # pylint: disable=import-outside-toplevel

  multihost.get_barrier_sync_fn()(key=f'dlmjax_{name}', timeout_ms=timeout_s * 1000)


def data_shard(batch_sharding, global_batch_size: int) -> tuple[int, int]:
  """(index, count): this process feeds rows [index, index + 1) x global_batch_size / count.

  make_array_from_process_local_data wants each process to pass exactly the rows its devices
  hold; read them from the sharding rather than assume block jax.process_index() (a device order
  or a batch-replicating axis across processes changes that; replicas load the same block).
  """
  rows = set()
  for index in batch_sharding.addressable_devices_indices_map((global_batch_size,)).values():
    rows.update(range(*index[0].indices(global_batch_size)))
  first, count = min(rows), len(rows)
  if rows != set(range(first, first + count)) or global_batch_size % count or first % count:
    raise LaunchError(
      f'this process holds batch rows {sorted(rows)[:4]}... of '
      f'{global_batch_size}, not one contiguous block; the mesh device order '
      'does not match the processes (report this with the mesh shape).'
    )
  return first // count, global_batch_size // count


def from_full_host(value, sharding):
  """A jax.Array laid out by `sharding` from a host value every process holds whole (the same on
  each): each process places the slices its devices own. jit refuses host numpy for a sharding
  that spans other processes' devices; this is the conversion it asks for."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(array):
  """The whole array as numpy, gathering shards from other processes when needed: the one
  device-to-host gather every program uses."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(jax.device_get(array))
