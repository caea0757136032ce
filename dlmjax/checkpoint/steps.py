"""The complete steps of a run's checkpoint directory, read from the directory alone.

orbax writes a step into a temporary directory and renames it to the bare step number on commit,
so a digit-named directory with its params item is complete. Nothing here imports orbax or JAX:
the watcher of a multi-process run (train/peer_watch.py) names the step to resume from with it.
"""

from __future__ import annotations

import os


def committed_steps(directory: str) -> list[int]:
  """The steps completely written under `directory` (<run>/checkpoints), oldest first."""
  if not os.path.isdir(directory):
    return []
  return sorted(
    int(n)
    for n in os.listdir(directory)
    if n.isdigit() and os.path.isdir(os.path.join(directory, n, 'params'))
  )
