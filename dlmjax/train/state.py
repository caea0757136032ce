"""The train state {step, params, opt_state}: abstract shapes, shardings and born-sharded init.

The state is a plain dict of arrays, so orbax saves it as is and the converter reads `params`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dlmjax import model as model_lib
from dlmjax.parallel import rules
from dlmjax.train import optimizer as optimizer_lib


class TrainSetup:
  """What every stage shares: model config, optimizer, abstract state and its shardings."""

  def __init__(self, config, mesh):
    self.config = config
    self.mesh = mesh
    self.model_config = model_lib.ModelConfig.from_config(config, pipeline=True)
    _, self.param_shapes, self.param_axes = model_lib.abstract(self.model_config)
    self.optimizer = optimizer_lib.make_optimizer(config.train, self.param_axes)
    self.param_shardings = rules.tree_shardings(mesh, self.param_axes)
    abstract_opt = jax.eval_shape(self.optimizer.init, self.param_shapes)
    self.state_shapes = dict(
      step=jax.ShapeDtypeStruct((), jnp.int32), params=self.param_shapes, opt_state=abstract_opt
    )
    self.state_shardings = dict(
      step=self.replicated,
      params=self.param_shardings,
      opt_state=_opt_state_shardings(
        abstract_opt, self.param_shapes, self.param_shardings, self.replicated
      ),
    )

  @property
  def replicated(self):
    return NamedSharding(self.mesh, PartitionSpec())

  def init_state(self, seed: int) -> dict:
    """Random params and fresh optimizer state, created directly in their shardings."""

    def init(key):
      params = model_lib.init_params(self.model_config, key)
      return dict(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params)
      )

    return jax.jit(init, out_shardings=self.state_shardings)(jax.random.key(seed))

  def state_from_params(self, params: dict) -> dict:
    """A step-0 state around given params (fine-tuning from a checkpoint or an import)."""

    def init(params):
      return dict(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params)
      )

    return jax.jit(init, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings)(
      params
    )


def _opt_state_shardings(abstract_opt, param_shapes, param_shardings, replicated):
  """Optimizer leaves shaped like a param (Adam moments) take that param's sharding."""
  by_path = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes)[0]:
    by_path[_keys(path)] = (leaf.shape, _lookup(param_shardings, path))

  def sharding_for(path, leaf):
    keys = _keys(path)
    for start in range(len(keys)):
      hit = by_path.get(keys[start:])
      if hit is not None and hit[0] == leaf.shape:
        return hit[1]
    return replicated

  return jax.tree_util.tree_map_with_path(sharding_for, abstract_opt)


def _keys(path):
  return tuple(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None))) for k in path)


def _lookup(tree, path):
  for k in _keys(path):
    tree = tree[k]
  return tree
