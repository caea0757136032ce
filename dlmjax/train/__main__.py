"""python -m dlmjax.train --config=configs/<stage>.py [--config.a.b=value ...]

On several hosts every process runs this same command; dlmjax.parallel.distributed reads the
launch environment (explicit, MegaDLMs' envs/.env, or SLURM) before any device is touched, and
train.peer_watch turns a peer's death into one line.
"""

import os

from dlmjax import cli
from dlmjax.train import preemption

CONFIG_FILE = 'configs/tiny.py'  # without --config

preemption.install_early()  # before the heavy imports below: a SIGTERM now stops cleanly too
if __name__ == '__main__':  # a config error in about a second, before jax and the model load
  cli.check_command_line(CONFIG_FILE)

from dlmjax.checkpoint import run_dir as run_dir_lib  # noqa: E402
from dlmjax.parallel import distributed  # noqa: E402
from dlmjax.train import loop, peer_watch  # noqa: E402


def main(argv, config):
  del argv
  launch = distributed.launch_from_env()
  if launch.is_multiprocess:
    checkpoints = os.path.join(os.path.abspath(config.output_dir), run_dir_lib.CHECKPOINT_DIR)
    peer_watch.start(
      launch.process_id, launch.num_processes, launch.heartbeat_timeout_s, checkpoints
    )
  distributed.initialize()
  loop.train(config)


if __name__ == '__main__':
  cli.run(main, config_file=CONFIG_FILE)
