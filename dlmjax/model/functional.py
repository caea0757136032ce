"""The model as pure functions of a parameter dict: build, abstract shapes, logical axes, apply.

Training state holds plain nested dicts of arrays (`nnx.to_pure_dict`), which optax, orbax and the
PyTorch converter all read directly; `apply` merges them into the NNX module at trace time.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from dlmjax.model.presets import ModelConfig
from dlmjax.model.transformer import Transformer, computed_params, inference_config
from dlmjax.parallel import rules


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


def inference_module(
  cfg: ModelConfig, params: dict, *, fuse: bool = True, mesh=None, experts_in_place: bool = True
) -> Transformer:
  """The module a program running many forwards over the same weights (every decode: the
  sampler's generate, serving, RL rollouts, evaluation, infilling) builds once, outside its
  loop: computed_params in inference_config's layout (weights cast to the compute dtype; with
  fuse, q / k / v and gate / up each one weight, unless `mesh` splits the heads; an MoE's routed
  experts read in place, unless experts_in_place=False)."""
  fuse = fuse and not splits_projections(mesh)
  layout = inference_config(cfg, fuse=fuse, experts_in_place=experts_in_place)
  return merge(layout, computed_params(cfg, params, fuse=fuse))


def splits_projections(mesh) -> bool:
  """Whether `mesh` shards the projections' output axes (heads, MLP width: mesh.tensor). A
  fused weight's shards would then each hold a slice of [q | k | v] other than the heads its
  attention computes, and the split after the matmul would move them between devices: such a
  mesh decodes with the trained layout."""
  if mesh is None:
    return False
  names = {a for axis in (rules.HEADS, rules.KV_HEADS, rules.MLP) for a in rules.RULES[axis]}
  return any(mesh.shape.get(name, 1) > 1 for name in names)
