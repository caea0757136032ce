"""Logical axis names and the ONE table that maps them to mesh axes.

Model code names the axes of every parameter and activation with these constants; only this module
(and mesh construction, in the order of config.MESH_AXES) knows the mesh axis names. Changing a
parallel layout means editing RULES.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec

# Logical axes of parameters.
LAYERS = 'layers'
VOCAB = 'vocab'
EMBED = 'embed'
HEADS = 'heads'
KV_HEADS = 'kv_heads'
HEAD_DIM = 'head_dim'
MLP = 'mlp'
EXPERT = 'expert'  # MoE experts (model/moe.py)
NORM = 'norm'
# Logical axes of activations.
BATCH = 'batch'
LENGTH = 'length'
ACT_EMBED = 'act_embed'
ACT_HEADS = 'act_heads'
ACT_MLP = 'act_mlp'
ACT_VOCAB = 'act_vocab'
# Query/key/value heads inside the attention kernel: with context parallelism the sequence is
# gathered and the heads split instead (an all-to-all over heads, DeepSpeed-Ulysses), so every
# mask kind and document mask stays exact.
ATTN_HEADS = 'attn_heads'
STAGE = 'stage'  # the pipeline-stage axis of the stage-major layer and activation views.

RULES: dict[str, tuple[str, ...]] = {
  LAYERS: ('pipeline',),  # the stacked layer axis: GPipe stages are contiguous layer blocks.
  STAGE: ('pipeline',),
  VOCAB: ('tensor',),
  EMBED: ('fsdp', 'context'),  # context devices would otherwise hold copies: shard over both.
  HEADS: ('tensor',),
  KV_HEADS: ('tensor',),
  HEAD_DIM: (),
  MLP: ('tensor',),
  EXPERT: ('expert',),
  NORM: (),
  BATCH: ('data', 'fsdp', 'expert'),
  LENGTH: ('context',),
  ACT_EMBED: (),
  ACT_HEADS: ('tensor',),
  ACT_MLP: ('tensor',),
  ACT_VOCAB: ('tensor',),
  ATTN_HEADS: ('tensor', 'context'),
}


def spec(logical_axes) -> PartitionSpec:
  """PartitionSpec for a tuple of logical axis names (None = replicated dimension)."""
  parts = []
  for name in logical_axes:
    mesh_axes = RULES[name] if name is not None else ()
    parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*parts)


def mesh_axes(logical_axis: str) -> tuple[str, ...]:
  """The mesh axes a logical axis is split over (for vmap's spmd_axis_name and collectives)."""
  return RULES[logical_axis]


def named_sharding(mesh, logical_axes) -> NamedSharding:
  return NamedSharding(mesh, spec(logical_axes))


def tree_shardings(mesh, axes_tree):
  """NamedShardings for a pytree whose leaves are logical-axis tuples."""
  return jax.tree.map(
    lambda axes: named_sharding(mesh, axes), axes_tree, is_leaf=lambda x: isinstance(x, tuple)
  )


_ACTIVE_MESH: contextvars.ContextVar = contextvars.ContextVar('dlmjax_mesh', default=None)


@contextlib.contextmanager
def activation_mesh(mesh):
  """While tracing under this context, `constrain` pins activations to `mesh`."""
  token = _ACTIVE_MESH.set(mesh)
  try:
    yield
  finally:
    _ACTIVE_MESH.reset(token)


def current_mesh():
  """The mesh of the enclosing `activation_mesh`, or None (for kernels that shard_map)."""
  return _ACTIVE_MESH.get()


def per_shard(fn, args, in_axes, out_axes):
  """fn(*args) run on each device's shard under the activation mesh (plainly without one).

  For kernels (pallas_call) that have no partitioning rule: left to GSPMD, every device would
  gather and compute the whole array. in_axes gives each arg's logical axes (() replicates it;
  a None arg stays None); out_axes one output's, or a list of them for a tuple of outputs.
  """
  mesh = _ACTIVE_MESH.get()
  if mesh is None or mesh.size == 1:
    return fn(*args)
  in_specs = tuple(None if a is None else spec(axes) for a, axes in zip(args, in_axes))
  out_specs = (
    tuple(spec(axes) for axes in out_axes) if isinstance(out_axes, list) else spec(out_axes)
  )
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *args
  )


def constrain(x, logical_axes):
  """Sharding constraint on an activation; a no-op outside `activation_mesh` (e.g. eager CPU)."""
  mesh = _ACTIVE_MESH.get()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes))
