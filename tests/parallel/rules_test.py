"""Sharding rules: every large parameter is split on an 8-device mesh (MaxText's assert)."""

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.parallel import rules
from tests.conftest import tiny_test_config


def test_large_params_are_sharded():
  config = tiny_test_config(**{'mesh.fsdp': 4, 'mesh.tensor': 2})
  mesh = mesh_lib.make_mesh(config)
  _, shapes, axes = model_lib.abstract(model_lib.ModelConfig.from_config(config))
  shardings = rules.tree_shardings(mesh, axes)
  for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    per_device = np.prod(sharding.shard_shape(shape.shape))
    if np.prod(shape.shape) >= 1024:
      assert per_device * 8 == np.prod(shape.shape), (shape, sharding.spec)


def test_spec_from_logical_names():
  assert rules.spec((rules.BATCH, None)) == jax.sharding.PartitionSpec(('data', 'fsdp'), None)
  assert rules.spec((rules.LAYERS, rules.EMBED, rules.MLP)) == jax.sharding.PartitionSpec(
    'pipeline', ('fsdp', 'context'), 'tensor'
  )


def test_constrain_is_a_noop_without_mesh():
  x = np.ones((2, 2))
  assert rules.constrain(x, (rules.BATCH, None)) is x
