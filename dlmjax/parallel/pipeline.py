"""Pipeline parallelism for the stacked layers: GPipe and circular schedules in one SPMD loop.

The layer stack [L, ...] is viewed as [repeats, stages, layers per stage, ...] with the stage axis
sharded over the pipeline mesh axis (MaxText's "vmap over stages" design, reference 1.3). Every
iteration runs all stages at once (a vmap whose stage axis lives on the pipeline devices), then
rolls the activations one stage on (a collective permute). Stage s runs micro-batch (t - s) mod M
of repeat (t - s) // M at iteration t; the last stage's output returns to stage 0 for the next
repeat (circular) or is the result (after the last repeat). Autodiff of the loop gives the
backward pipeline, so losses and gradients are those of the plain layer scan.

With aux=True each stage also returns per-layer values (an MoE's router sums); every busy
(stage, iteration) writes them to its (micro-batch, layer) slot, and bubble iterations, which run
on stale rows, write nothing.

Layer l belongs to repeat l // (S * Lps), stage (l // Lps) % S: repeats=1 is GPipe, whose stages
are contiguous layer blocks, exactly the layer axis' own sharding. With repeats > 1 the stage
view is a different split of the stored axis, which costs one all-to-all of the weights per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.parallel import rules


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
  """Idle share of the schedule: (S - 1) / (R * M + S - 1) (MaxText's formula, reference 1.3)."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def check_schedule(
  num_layers: int, batch: int, *, stages: int, repeats: int, microbatches: int
) -> None:
  """ValueError naming the fix for a stack or batch the schedule cannot split."""
  if num_layers % (stages * repeats):
    raise ValueError(
      f'{num_layers} layers do not split into {stages} pipeline stages x '
      f'{repeats} repeats; make model.num_layers a multiple of mesh.pipeline x '
      'mesh.pipeline_repeats.'
    )
  if batch % microbatches:
    raise ValueError(
      f'a batch of {batch} rows does not split into {microbatches} pipeline '
      'micro-batches; make the batch a multiple of mesh.pipeline_microbatches.'
    )
  if repeats > 1 and microbatches < stages:
    raise ValueError(
      f'the circular schedule ({repeats} repeats) needs at least one micro-batch '
      f'per stage, got {microbatches} for {stages} stages; raise '
      'mesh.pipeline_microbatches.'
    )


def _split(x, num):
  """[B, ...] -> [num, B/num, ...], micro-batch i = rows {j * num + i} (strided, as the train
  step's micro-batches, so each spans every batch-parallel device without moving data)."""
  return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)


def _merge(x):
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _stage_major(w, stages, repeats):
  """[L, ...] in contiguous per-device layer blocks -> [R, S, Lps, ...] with stage s's layers on
  device s, by one all-to-all (left to itself, XLA all-gathers the whole stack on every device).

  Device d holds blocks q in [d R, (d + 1) R) of Lps layers; block q = r S + s goes to device s.
  Each device sends device s its blocks of residue s mod S (at most ceil(R / S) of them, padded).
  """
  S, R = stages, repeats  # noqa: N806
  per_stage = w.shape[0] // (S * R)
  mesh = rules.current_mesh()
  axis = rules.mesh_axes(rules.STAGE)
  if mesh is None or mesh.shape[axis[0]] != S:  # no pipeline devices: a plain reshape
    return w.reshape(R, S, per_stage, *w.shape[1:])
  slots = -(-R // S)

  def local(w_local):
    blocks = w_local.reshape(R, per_stage, *w_local.shape[1:])
    d = jax.lax.axis_index(axis)
    k_SC = (jnp.arange(S)[:, None] - d * R) % S + S * jnp.arange(slots)[None, :]
    send = jnp.where(
      (k_SC < R).reshape(S, slots, *([1] * (blocks.ndim - 1))), blocks[jnp.minimum(k_SC, R - 1)], 0
    )
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [S sources, slots, Lps, ...]
    s = jax.lax.axis_index(axis)
    q_R = jnp.arange(R) * S + s
    source_R = q_R // R
    slot_R = (q_R - source_R * R - (s - source_R * R) % S) // S
    return recv[source_R, slot_R][:, None]

  spec = jax.sharding.PartitionSpec
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=spec(axis),
    out_specs=spec(None, axis),
    axis_names=set(axis),
    check_vma=False,
  )(w)


def _side_axes(x):
  return (rules.BATCH, rules.LENGTH)[: x.ndim]


def run(
  stage_fn,
  params,
  param_axes,
  x_BLD,
  side,
  *,
  stages: int,
  repeats: int = 1,
  microbatches: int = 1,
  aux: bool = False,
):
  """The stack applied to x_BLD through the pipeline schedule; with aux, (x, aux) where aux holds
  stage_fn's per-layer values of every micro-batch, leaves [M, L, ...] (layer in stack order).

  Args:
    stage_fn: (params with [Lps, ...] leaves, x_bLD, side_b) -> x_bLD, the plain layer scan; with
      aux, -> (x_bLD, a tree of [Lps, ...] leaves, or None).
    params: nested dict of stacked layer params, leaves [L, ...].
    param_axes: the same tree with logical-axis tuples (leading rules.LAYERS).
    x_BLD: the stack's input.
    side: dict of per-row arrays ([B] or [B, L]: positions, segment ids, valid lengths) that each
      stage needs for the micro-batch it is running.
  """
  num_layers = jax.tree.leaves(params)[0].shape[0]
  check_schedule(
    num_layers, x_BLD.shape[0], stages=stages, repeats=repeats, microbatches=microbatches
  )
  S, R, M = stages, repeats, microbatches  # noqa: N806 (the schedule's letters)
  per_stage = num_layers // (S * R)
  is_axes = lambda a: isinstance(a, tuple)  # noqa: E731

  def stage_view(axes, w):  # [L, ...] -> [R, S, Lps, ...], stage axis on the pipeline devices
    w = _stage_major(w, S, R) if R > 1 else w.reshape(1, S, per_stage, *w.shape[1:])
    return rules.constrain(w, (None, rules.STAGE, None, *axes[1:]))

  weights = jax.tree.map(stage_view, param_axes, params, is_leaf=is_axes)
  act = (rules.BATCH, rules.LENGTH, rules.ACT_EMBED)
  micro_x = rules.constrain(_split(x_BLD, M), (None, *act))
  micro_side = {k: rules.constrain(_split(v, M), (None, *_side_axes(v))) for k, v in side.items()}
  stage_ids = jnp.arange(S)
  # Every stage keeps its own copy of the micro-batch buffer; only stage 0's copy is read and
  # written meaningfully, so feeding and collecting stay local to each device.
  io = jnp.broadcast_to(micro_x[None], (S, *micro_x.shape))
  io = rules.constrain(io, (rules.STAGE, None, *act))
  outputs = rules.constrain(jnp.zeros((S, *micro_x.shape[1:]), x_BLD.dtype), (rules.STAGE, *act))

  def run_stage(w_R, x, repeat, side_b):
    # This stage's weights for its current repeat: a one-hot sum over the few repeats keeps the
    # pick elementwise, so it stays on the stage's device whatever the partitioner does.
    if R == 1:
      w = jax.tree.map(lambda a: a[0], w_R)
    else:
      pick_R = jax.nn.one_hot(repeat, R)
      w = jax.tree.map(lambda a: jnp.tensordot(pick_R.astype(a.dtype), a, axes=1), w_R)
    return stage_fn(w, x, side_b)

  stages_fn = jax.vmap(run_stage, in_axes=(1, 0, 0, 0), spmd_axis_name=rules.mesh_axes(rules.STAGE))
  aux_shapes = None
  if aux:
    first_side = {k: jnp.broadcast_to(v[:1], (S, *v.shape[1:])) for k, v in micro_side.items()}
    aux_shapes = jax.eval_shape(stages_fn, weights, io[:, 0], jnp.zeros(S, jnp.int32), first_side)
    aux_shapes = aux_shapes[1]
  else:
    stages_fn = (lambda f: lambda *a: (f(*a), None))(stages_fn)

  def stage_spec(ndim):
    return (rules.STAGE, *([None] * (ndim - 1)))

  # [S, R, M, Lps, ...]: stage s's values for its layers of repeat r on micro-batch m.
  slots = jax.tree.map(
    lambda a: rules.constrain(jnp.zeros((S, R, M, *a.shape[1:]), a.dtype), stage_spec(a.ndim + 2)),
    aux_shapes,
  )

  def store(slots, values, t, micro, repeat):
    busy_S = (t - stage_ids >= 0) & (t - stage_ids < R * M)  # bubbles: stale rows, no values
    place_SRM = jax.nn.one_hot(repeat, R)[:, :, None] * jax.nn.one_hot(micro, M)[:, None, :]

    def add(slot, value):
      value = jnp.where(busy_S.reshape(S, *([1] * (value.ndim - 1))), value, 0)
      weight = place_SRM.reshape(S, R, M, *([1] * (value.ndim - 1))).astype(value.dtype)
      return rules.constrain(slot + weight * value[:, None, None], stage_spec(slot.ndim))

    return jax.tree.map(add, slots, values)

  def collect(outputs, io, t):
    """Rolls stage outputs one stage on; stage 0 stores what the last stage finished at t - 1."""
    rolled = rules.constrain(jnp.roll(outputs, 1, axis=0), (rules.STAGE, *act))
    index = (t - S) % M
    old = jax.lax.dynamic_index_in_dim(io, index, 1, keepdims=False)
    new = jnp.where(t >= S, rolled, old)
    io = jax.lax.dynamic_update_index_in_dim(io, new, index, 1)
    return rolled, rules.constrain(io, (rules.STAGE, None, *act))

  def iteration(carry, t):
    outputs, io, slots = carry
    rolled, io = collect(outputs, io, t)
    fresh = jax.lax.dynamic_index_in_dim(io, t % M, 1, keepdims=False)
    first = (stage_ids == 0).reshape(S, *([1] * (fresh.ndim - 1)))
    inputs = rules.constrain(jnp.where(first, fresh, rolled), (rules.STAGE, *act))
    micro = (t - stage_ids) % M
    repeat = jnp.clip((t - stage_ids) // M, 0, R - 1)
    side_S = {
      k: rules.constrain(jnp.take(v, micro, axis=0), (rules.STAGE, *_side_axes(v[0])))
      for k, v in micro_side.items()
    }
    outputs, values = stages_fn(weights, inputs, repeat, side_S)
    outputs = rules.constrain(outputs, (rules.STAGE, *act))
    return (outputs, io, store(slots, values, t, micro, repeat)), None

  num_iterations = R * M + S - 1
  carry = (outputs, io, slots)
  (outputs, io, slots), _ = jax.lax.scan(iteration, carry, jnp.arange(num_iterations))
  _, io = collect(outputs, io, num_iterations)
  x_BLD = rules.constrain(_merge(io[0]), act)
  if not aux:
    return x_BLD
  # [S, R, M, Lps, ...] -> [M, R, S, Lps, ...] -> [M, L, ...]: layer r S Lps + s Lps + j.
  per_layer = jax.tree.map(
    lambda a: jnp.moveaxis(a, 2, 0).swapaxes(1, 2).reshape(M, num_layers, *a.shape[4:]), slots
  )
  return x_BLD, per_layer
