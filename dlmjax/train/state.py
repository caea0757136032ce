"""The train state {step, params, opt_state[, the stage's carried state]}: abstract shapes,
shardings and born-sharded init. A stage's carried state (stages/base.py CarriedState; RL's
refreshed KL reference, key `reference`) is checkpointed and resumed with the rest.

The state is a plain dict of arrays, so orbax saves it as is and the converter reads `params`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dlmjax import model as model_lib
from dlmjax.model import lora
from dlmjax.parallel import rules
from dlmjax.train import lora_setup, stages
from dlmjax.train import optimizer as optimizer_lib


class TrainSetup:
  """What every stage shares: model config, optimizer, abstract state and its shardings.

  param_shapes / param_shardings: the whole model as programs see it. With LoRA
  (train.lora.rank > 0, train/lora_setup.py) that is the adapters (the train state's params,
  trainable_*) plus the frozen base (frozen_*, held in `frozen`, not in the state); without, the
  state's params are the whole model and `frozen` is empty.
  """

  def __init__(self, config, mesh, stage=None):
    """stage: the run's Stage (built from the config when not given), for its carried state."""
    self.config = config
    self.carried = (stage or stages.build(config)).carried
    self.mesh = mesh
    self.lora = lora_setup.enabled(config)
    self.model_config = lora.with_adapters(
      model_lib.ModelConfig.from_config(config, pipeline=True), config
    )
    _, shapes, self.param_axes = model_lib.abstract(self.model_config)
    if self.lora:
      trainable_shapes, base_shapes = lora.split(shapes)
      trainable_axes, frozen_axes = lora.split(self.param_axes)
      self.frozen_shapes = lora_setup.frozen_shapes(base_shapes, config)
      self.frozen_shardings = rules.tree_shardings(mesh, frozen_axes)
      self.param_shapes = lora.combine(trainable_shapes, self.frozen_shapes)
    else:
      trainable_shapes, trainable_axes, self.param_shapes = shapes, self.param_axes, shapes
      self.frozen_shapes, self.frozen_shardings = {}, {}
    self.frozen = {}
    self.trainable_shapes = trainable_shapes
    self.trainable_shardings = rules.tree_shardings(mesh, trainable_axes)
    self.param_shardings = rules.tree_shardings(mesh, self.param_axes)
    self.optimizer = optimizer_lib.make_optimizer(config.train, trainable_axes)
    abstract_opt = jax.eval_shape(self.optimizer.init, trainable_shapes)
    self.state_shapes = dict(
      step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable_shapes, opt_state=abstract_opt
    )
    self.state_shardings = dict(
      step=self.replicated,
      params=self.trainable_shardings,
      opt_state=_opt_state_shardings(
        abstract_opt, trainable_shapes, self.trainable_shardings, self.replicated
      ),
    )
    if self.carried is not None:  # shaped and sharded like the trainable params
      self.state_shapes[self.carried.key] = jax.eval_shape(self.carried.init, trainable_shapes)
      self.state_shardings[self.carried.key] = self.trainable_shardings

  @property
  def replicated(self):
    return NamedSharding(self.mesh, PartitionSpec())

  def model_params(self, params: dict) -> dict:
    """The whole model's params of a state's params (the adapters joined to the frozen base)."""
    return lora.combine(params, self.frozen) if self.lora else params

  def set_base(self, base: dict) -> None:
    """Holds the frozen base of a LoRA run: float params as init_from restores them (no
    adapters), converted to train.lora.base_dtype in the frozen shardings; a head the adapters'
    side trains (a reward model's fresh score head, lora.TRAINED_WHOLE) is not part of it."""
    cfg, config = self.model_config, self.config
    self.frozen = jax.jit(
      lambda p: lora_setup.freeze(lora.split(p)[1], cfg, config),
      out_shardings=self.frozen_shardings,
    )(base)

  def init_state(self, seed: int) -> dict:
    """Random params and fresh optimizer state, created directly in their shardings. With LoRA
    the base is random too (benchmarks and tests; runs start from init_from)."""
    if self.lora:  # one program, so a float32 copy of the whole base never exists at once
      base_cfg = model_lib.ModelConfig.from_config(self.config, pipeline=True)
      cfg, config = self.model_config, self.config
      self.frozen = jax.jit(
        lambda k: lora_setup.freeze(lora.split(model_lib.init_params(base_cfg, k))[1], cfg, config),
        out_shardings=self.frozen_shardings,
      )(jax.random.key(seed))
      return self.state_from_params(
        lora_setup.init_adapters(self.trainable_shapes, seed, cfg.init_std)
      )

    def init(key):
      params = model_lib.init_params(self.model_config, key)
      return self._fresh_state(params)

    return jax.jit(init, out_shardings=self.state_shardings)(jax.random.key(seed))

  def _fresh_state(self, params: dict) -> dict:
    state = dict(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params)
    )
    if self.carried is not None:
      state[self.carried.key] = self.carried.init(params)
    return state

  def state_from_params(self, params: dict) -> dict:
    """A step-0 state around given params (fine-tuning from a checkpoint or an import; the
    adapters of a LoRA run)."""

    def init(params):
      return self._fresh_state(params)

    return jax.jit(
      init, in_shardings=(self.trainable_shardings,), out_shardings=self.state_shardings
    )(params)


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
