"""Builds the device mesh from config.mesh (axis order: pipeline, data, fsdp, expert, context,
tensor)."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils

from dlmjax import config as config_lib


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """A mesh over all (or the given) devices. Resolves a -1 axis of config.mesh in place and
  validates the shape first, so a mis-sized mesh fails with a readable error."""
  devices = jax.devices() if devices is None else devices
  config_lib.fit_to_devices(config, len(devices))
  m = config.mesh
  shape = tuple(m[axis] for axis in config_lib.MESH_AXES)
  try:
    device_grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, AssertionError, NotImplementedError):
    device_grid = np.asarray(devices).reshape(shape)
  return jax.sharding.Mesh(device_grid, config_lib.MESH_AXES)
