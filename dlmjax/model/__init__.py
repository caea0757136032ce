"""The model as pure functions of a parameter dict: build, abstract shapes, logical axes, apply.

Training state holds plain nested dicts of arrays (`nnx.to_pure_dict`), which optax, orbax and the
PyTorch converter all read directly; `apply` merges them into the NNX module at trace time.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from dlmjax.model.presets import PRESETS, ModelConfig, apply_preset
from dlmjax.model.transformer import Transformer, computed_params, inference_config
from dlmjax.parallel import rules

__all__ = [
  'computed_params',
  'inference_config',
  'inference_module',
  'ModelConfig',
  'PRESETS',
  'Transformer',
  'apply_preset',
  'init_params',
  'abstract',
  'merge',
  'param_placement',
]


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def init_params(cfg: ModelConfig, key) -> dict:
  """Random float32 parameters as a nested dict (jit this with out_shardings to init sharded)."""
  model = Transformer(cfg, rngs=nnx.Rngs(params=key))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.lru_cache(maxsize=16)
def abstract(cfg: ModelConfig):
  """(graphdef, params as ShapeDtypeStructs, params' logical axes) without allocating anything."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  shapes = nnx.to_pure_dict(
    jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.value.shape, v.value.dtype), state, is_leaf=_is_variable
    )
  )
  axes = nnx.to_pure_dict(
    jax.tree.map(lambda v: v.get_metadata()['axes'], state, is_leaf=_is_variable)
  )
  return graphdef, shapes, axes


def param_placement(config, mesh=None):
  """(params as ShapeDtypeStructs, their shardings) of a run config's model, to restore into: the
  mesh's shardings from the logical axes, or the first local device."""
  _, shapes, axes = abstract(ModelConfig.from_config(config))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return shapes, jax.tree.map(lambda _: device, shapes)
  return shapes, rules.tree_shardings(mesh, axes)


def merge(cfg: ModelConfig, params: dict) -> Transformer:
  """The Transformer module holding `params` (cheap: reuses the cached graph definition)."""
  graphdef, _, _ = abstract(cfg)
  return nnx.merge(graphdef, params)


def inference_module(cfg: ModelConfig, params: dict, *, fuse: bool = True) -> Transformer:
  """The module a program running many forwards over the same weights (the sampler's decode)
  builds once, outside its loop: computed_params in inference_config's layout (weights cast
  to the compute dtype; with fuse, q / k / v and gate / up each one weight)."""
  return merge(inference_config(cfg, fuse=fuse), computed_params(cfg, params, fuse=fuse))
