"""Launch-environment parsing: every source, and a clear error for each inconsistency."""

import pytest

from dlmjax.parallel import distributed
from dlmjax.parallel.distributed import Launch, LaunchError, launch_from_env

_SLURM = dict(
  SLURM_JOB_ID='4242',
  SLURM_STEP_NODELIST='gpu[007-010,012],cpu1',
  SLURM_NTASKS='16',
  SLURM_PROCID='9',
  SLURM_LOCALID='1',
  SLURM_STEP_NUM_NODES='2',
)
_MEGADLMS = dict(
  MASTER_ADDR='10.0.0.1', MASTER_PORT='29500', NUM_NODES='4', NODE_RANK='3', GPUS_PER_NODE='8'
)


def test_nothing_set_is_one_process():
  assert launch_from_env({}) == Launch('single')
  assert not launch_from_env({'PATH': '/bin'}).is_multiprocess


def test_explicit():
  env = dict(COORDINATOR_ADDRESS='host0:1234', NUM_PROCESSES='4', PROCESS_ID='2')
  assert launch_from_env(env) == Launch('explicit', 4, 2, 'host0:1234')
  env['LOCAL_DEVICE_IDS'] = '4,5'
  assert launch_from_env(env).local_device_ids == (4, 5)


def test_megadlms_one_process_per_node_by_default():
  assert launch_from_env(_MEGADLMS) == Launch('megadlms', 4, 3, '10.0.0.1:29500')


def test_megadlms_one_process_per_gpu_when_the_launcher_sets_local_rank():
  launch = launch_from_env(dict(_MEGADLMS, LOCAL_RANK='5'))
  assert launch == Launch('megadlms', 32, 3 * 8 + 5, '10.0.0.1:29500', (5,))


@pytest.mark.parametrize(
  'nodelist,first',
  [
    ('node001', 'node001'),
    ('node001,host2', 'node001'),
    ('node[001-015],host2', 'node001'),
    ('node[003,007-015]', 'node003'),
    ('gpu[12]', 'gpu12'),
    ('a-b-1,a-b-2', 'a-b-1'),
  ],
)
def test_first_hostname(nodelist, first):
  assert distributed.first_hostname(nodelist) == first


def test_slurm_one_task_per_gpu():
  launch = launch_from_env(_SLURM)
  # JAX's port rule for SLURM: 61440 + job id % 4096.
  assert launch == Launch('slurm', 16, 9, f'gpu007:{61440 + 4242 % 4096}', (1,))
  # srun --gpus-per-task=1 already restricted the task to one GPU: keep all visible ones.
  assert launch_from_env(dict(_SLURM, CUDA_VISIBLE_DEVICES='3')).local_device_ids is None
  assert launch_from_env(dict(_SLURM, JAX_COORDINATOR_PORT='5000')).coordinator_address == (
    'gpu007:5000'
  )


def test_slurm_one_task_per_node_drives_all_its_gpus():
  launch = launch_from_env(dict(_SLURM, SLURM_NTASKS='2', SLURM_PROCID='1', SLURM_LOCALID='0'))
  assert launch == Launch('slurm', 2, 1, f'gpu007:{61440 + 4242 % 4096}', None)


def test_slurm_single_task_and_incomplete_slurm_are_one_process():
  assert launch_from_env(dict(_SLURM, SLURM_NTASKS='1', SLURM_PROCID='0')) == Launch('single')
  # An sbatch script outside srun has no step node list: not a multi-process launch.
  batch_only = {k: v for k, v in _SLURM.items() if k != 'SLURM_STEP_NODELIST'}
  assert launch_from_env(batch_only) == Launch('single')


def test_the_script_launch_under_srun_is_consistent():
  """Our sbatch: one SLURM task per node runs the script, which starts 8 processes per GPU."""
  env = dict(_SLURM, SLURM_NTASKS='4', SLURM_PROCID='3', **_MEGADLMS, LOCAL_RANK='0')
  assert launch_from_env(env).num_processes == 32


@pytest.mark.parametrize(
  'env,message',
  [
    (dict(COORDINATOR_ADDRESS='h:1', NUM_PROCESSES='2'), 'PROCESS_ID missing'),
    (dict(COORDINATOR_ADDRESS='h', NUM_PROCESSES='2', PROCESS_ID='0'), 'is not host:port'),
    (dict(COORDINATOR_ADDRESS='h:1', NUM_PROCESSES='2', PROCESS_ID='2'), 'PROCESS_ID=2 must be'),
    (dict(COORDINATOR_ADDRESS='h:1', NUM_PROCESSES='two', PROCESS_ID='0'), 'not an integer'),
    (dict(COORDINATOR_ADDRESS='h:1', NUM_PROCESSES='0', PROCESS_ID='0'), 'must be >= 1'),
    (dict(_MEGADLMS, NODE_RANK=''), 'NODE_RANK missing'),
    (dict(_MEGADLMS, NODE_RANK='4'), 'NODE_RANK=4 must be in [0, NUM_NODES=4)'),
    (dict(_MEGADLMS, MASTER_PORT='70000'), 'not a TCP port'),
    (dict(_MEGADLMS, LOCAL_RANK='8'), 'LOCAL_RANK=8 must be in [0, GPUS_PER_NODE=8)'),
    (dict(_MEGADLMS, LOCAL_RANK='0', GPUS_PER_NODE=''), 'GPUS_PER_NODE missing'),
    (dict(_MEGADLMS, LOCAL_DEVICE_IDS='0,0'), 'distinct device ids'),
    (dict(_SLURM, SLURM_PROCID='16'), 'SLURM_PROCID=16 is not below SLURM_NTASKS=16'),
    # envs/.env's single-node defaults sourced inside a 16-task srun: 16 lone trainers otherwise.
    (dict(_SLURM, **dict(_MEGADLMS, NUM_NODES='1', NODE_RANK='0')), 'SLURM started 16 tasks'),
  ],
)
def test_inconsistent_env_is_a_clear_error(env, message):
  with pytest.raises(LaunchError) as error:
    launch_from_env(env)
  assert message in str(error.value)


def test_initialize_single_process_touches_nothing(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(distributed, '_initialized', None)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: pytest.fail('called'))
  assert distributed.initialize({}) == Launch('single')


def test_initialize_passes_the_launch_to_jax_once(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel

  calls = []
  monkeypatch.setattr(distributed, '_initialized', None)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: calls.append(kw))
  env = dict(_MEGADLMS, LOCAL_RANK='2')
  assert distributed.initialize(env) == distributed.initialize(env)
  assert calls == [
    dict(
      coordinator_address='10.0.0.1:29500',
      num_processes=32,
      process_id=26,
      local_device_ids=[2],
      cluster_detection_method='deactivate',
      heartbeat_timeout_seconds=30,
    )
  ]


def test_heartbeat_timeout_is_a_launch_variable():
  env = dict(COORDINATOR_ADDRESS='host0:1234', NUM_PROCESSES='4', PROCESS_ID='2')
  assert launch_from_env(env).heartbeat_timeout_s == distributed.HEARTBEAT_TIMEOUT_S == 30
  assert launch_from_env(dict(env, HEARTBEAT_TIMEOUT_S='5')).heartbeat_timeout_s == 5
  for bad, message in (('0', 'HEARTBEAT_TIMEOUT_S=0 must be >= 1'), ('5s', 'not an integer')):
    with pytest.raises(LaunchError, match=message):
      launch_from_env(dict(env, HEARTBEAT_TIMEOUT_S=bad))
