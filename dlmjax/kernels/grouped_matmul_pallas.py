"""The grouped matmul of MoE experts as Pallas kernels: Triton on GPU, interpret mode off it.

out[r] = lhs[r] @ rhs[g(r)] over rows sorted by group (group_sizes consecutive rows each; rows
past their sum belong to no group and come out zero). Neither XLA's ragged_dot on GPU, which
expands the groups densely (tens of GiB in its backward at MoE shapes), nor a tokamax release
built for another jax is needed:

- Forward (`_gmm_kernel`): one program per [block_m, block_n] output tile. Row tiles are aligned
  and may straddle group boundaries (the megablox scheme): a tile -> group range table, computed
  from group_sizes in plain JAX, tells each program which groups its rows meet; for each it loads
  only that group's rows (a masked load, zeros elsewhere) and accumulates lhs @ rhs[g] over K in
  float32. A tile in one group (all but about one per group boundary) does one pass; an empty
  group costs nothing.
- d_lhs = grouped_matmul(d_out, rhs^T): the same kernel reading rhs transposed in place.
- d_rhs[g] = lhs_g^T @ d_out_g (`_tgmm_kernel`): one program per [block_k, block_n] tile of one
  group's matrix, looping over the row tiles that group meets. Empty groups get zeros.

No [G, M, ...] array ever exists; the extra work is the masked rows of straddling tiles (at most
one tile per group boundary). Dimensions are padded to whole tiles (zeros, so sums are exact):
Triton's blocks are powers of two, and a matmul needs at least 16 along every side.

The forward also reads one layer of a stacked [layers, G, K, N] rhs in place (`layer`): an
inference program hands every layer the whole stack of its experts and the layer's index, since a
custom call cannot read a slice where it lies and XLA would copy the layer's experts (all of
them, every step) into a buffer of their own first (docs/benchmarks.md, LLaDA2.0-mini).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_MIN_BLOCK = 16  # Triton's dot: every side at least 16.


@dataclasses.dataclass(frozen=True)
class Tile:
  """One kernel's tile: block_m rows x block_n columns of the output, block_k of the contraction
  per step (tgmm: block_k x block_n output, block_m rows per step), and Triton's warps and
  pipeline stages."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tiles of the three kernels (powers of two; shrunk for dimensions smaller than a tile). 128 x
  256 output tiles on 8 warps ran 1.19x (forward) and 1.18x (forward + backward) faster than 128 x
  128 on 4 at Qwen3-30B-A3B's expert shapes on one H200 (docs/benchmarks.md, MoE)."""

  fwd: Tile = Tile(128, 256, 64, 8, 3)
  dlhs: Tile = Tile(128, 256, 64, 8, 3)
  drhs: Tile = Tile(64, 256, 128, 8, 3)


# A decode step routes few rows to each expert (a batch-1 block of 32 tokens, top-8 of 256: one
# on average), so 128-row tiles are mostly masked and a call has a few programs, each reading
# many experts in turn. Tiles of 16 x 64 on 4 warps give every (expert, column) pair its own
# program: the LLaDA2.0-mini's batch-1 block step went 23.6 -> 9.1 ms on one H100, 32 x 128 11.1,
# 64 x 128 13.2 (docs/benchmarks.md, LLaDA2.0-mini).
DECODE_FWD = Tile(16, 64, 128, 4, 3)
DECODE_ROWS_PER_GROUP = 16  # at most this many rows per expert on average: the decode tile


def forward_tile(rows: int, groups: int, tiles: Tiles | None) -> Tile:
  """The forward's tile: the caller's, else the decode tile for few rows per expert."""
  if tiles is not None:
    return tiles.fwd
  return DECODE_FWD if rows <= DECODE_ROWS_PER_GROUP * groups else Tiles().fwd


def grouped_matmul(
  lhs_MK, rhs_GKN, group_sizes_G, *, layer=None, tiles: Tiles | None = None, interpret=None
):
  """[M, K] x [G, K, N] -> [M, N] in lhs's dtype, float32 accumulation; differentiable in lhs
  and rhs (rows outside every group: zero output, zero gradient). rhs is cast to lhs's dtype.
  `interpret` defaults to True off GPU.

  layer (an int or a traced int32 scalar): rhs is a stack [layers, G, K, N] and the product is
  with rhs[layer], read in place (module docstring). Forward only (inference programs): the
  gradient of a whole stack per layer would cost the stack's memory per layer."""
  stacked = layer is not None
  if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 + stacked or lhs_MK.shape[1] != rhs_GKN.shape[-2]:
    rhs = 'rhs [layers, G, K, N] with a layer' if stacked else 'rhs [G, K, N]'
    raise ValueError(
      f'grouped matmul takes lhs [M, K] and {rhs}, got {lhs_MK.shape} and {rhs_GKN.shape}'
    )
  if group_sizes_G.shape != rhs_GKN.shape[-3:-2]:
    raise ValueError(
      f'group_sizes {group_sizes_G.shape} must have one entry per group of rhs {rhs_GKN.shape}'
    )
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  rhs_GKN = rhs_GKN.astype(lhs_MK.dtype)
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  rows, groups = lhs_MK.shape[0], group_sizes_G.shape[0]
  tiles = dataclasses.replace(tiles or Tiles(), fwd=forward_tile(rows, groups, tiles))
  if not stacked:
    return _gmm(lhs_MK, rhs_GKN, group_sizes_G, tiles, interpret)
  starts, ends = _bounds(group_sizes_G, rows)
  return _forward(lhs_MK, rhs_GKN, starts, ends, tiles.fwd, interpret, layer=layer)


# ---------------------------------------------------------------------------------------------
# Shapes: tiles fitted to the dimensions, and the padding to whole tiles.


def _block(dim: int, block: int) -> int:
  """`block`, or the smallest power of two >= 16 that covers a dimension smaller than it."""
  return min(block, max(_MIN_BLOCK, pl.next_power_of_2(dim)))


def _pad_to(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _round_up(dim: int, block: int) -> int:
  return -(-dim // block) * block


def _bounds(group_sizes_G, rows: int):
  """int32 [G] starts and ends of each group's rows, clipped to the `rows` that exist."""
  ends = jnp.minimum(jnp.cumsum(group_sizes_G), rows).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def _tile_groups(starts_G, ends_G, num_tiles: int, block_m: int):
  """int32 [tiles, 2]: per aligned row tile, the range [lo, hi) of groups its rows meet (empty
  for a tile past every group). Groups of no rows inside the range are skipped by the kernel."""
  first = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
  total = ends_G[-1]
  last = jnp.minimum(first + block_m, total) - 1
  lo = jnp.searchsorted(ends_G, first, side='right')
  hi = jnp.searchsorted(ends_G, last, side='right') + 1
  hi = jnp.where(first < total, jnp.minimum(hi, ends_G.shape[0]), lo)
  return jnp.stack([lo, hi], -1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Kernels.


def _dot(a, b, *, trans_a=False, trans_b=False):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _load(ref, mask):
  """ref's block with zeros where mask is False (a masked load on GPU: the other rows are never
  read, so whatever they hold, NaN included, adds nothing)."""
  mask = jnp.broadcast_to(mask, ref.shape)
  return _masked_load()(ref, mask=mask, other=jnp.zeros((), ref.dtype))


@functools.cache
def _masked_load():
  """Pallas' masked load: jax.experimental.pallas.triton.load in current jax, pallas.load in
  releases before the Triton-specific one existed."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415

  return getattr(pltriton, 'load', None) or pl.load


def _gmm_kernel(
  tile_groups_ref,
  starts_ref,
  ends_ref,
  layer_ref,
  lhs_ref,
  rhs_ref,
  out_ref,
  *,
  block_k,
  transpose_rhs,
):
  """out tile (row tile program_id(1), column tile program_id(0)) = sum over the groups g its
  rows meet of lhs[rows of g] @ rhs[layer, g] (transpose_rhs: rhs[layer, g]^T, rhs stored
  [layers, G, N, K]); layer = layer_ref[0]."""
  block_m, block_n = out_ref.shape
  layer = layer_ref[0]
  num_k = lhs_ref.shape[1] // block_k
  n0 = pl.program_id(0) * block_n
  m0 = pl.program_id(1) * block_m
  rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  row_slice, col_slice = pl.ds(m0, block_m), pl.ds(n0, block_n)

  def group(g, acc):
    start, end = starts_ref[g], ends_ref[g]
    in_group = (rows >= start) & (rows < end)

    def step(kk, acc):
      ks = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
      x = _load(lhs_ref.at[row_slice, ks], in_group)
      if transpose_rhs:
        return acc + _dot(x, rhs_ref[layer, g, col_slice, ks], trans_b=True)
      return acc + _dot(x, rhs_ref[layer, g, ks, col_slice])

    # An empty group runs no K step. (Not jnp.where(end > start, num_k, 0): Pallas' Triton
    # lowering gives select's two literals the predicate's i1 type, so the loop fails to verify.)
    return lax.fori_loop(0, (end > start).astype(jnp.int32) * num_k, step, acc)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  acc = lax.fori_loop(tile_groups_ref[0], tile_groups_ref[1], group, acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, block_m):
  """out[g] tile (group program_id(2), K tile program_id(1), N tile program_id(0)) = sum over the
  aligned row tiles group g meets of lhs[rows of g]^T @ d_out[rows of g]."""
  block_k, block_n = out_ref.shape
  g = pl.program_id(2)
  k0 = pl.program_id(1) * block_k
  n0 = pl.program_id(0) * block_n
  start, end = starts_ref[g], ends_ref[g]
  first = start // block_m
  last = jnp.where(end > start, (end + block_m - 1) // block_m, first)
  k_slice, n_slice = pl.ds(k0, block_k), pl.ds(n0, block_n)

  def step(i, acc):
    m0 = pl.multiple_of(i * block_m, block_m)
    rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    in_group = (rows >= start) & (rows < end)
    x = _load(lhs_ref.at[pl.ds(m0, block_m), k_slice], in_group)
    # Both sides masked: a NaN left in a row of no group, times a masked zero, is still NaN.
    dy = _load(dout_ref.at[pl.ds(m0, block_m), n_slice], in_group)
    return acc + _dot(x, dy, trans_a=True)

  acc = lax.fori_loop(first, last, step, jnp.zeros((block_k, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wiring and the custom VJP.


def _params(tile, interpret):
  if interpret:
    return {}
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415

  # The name of current jax; releases before 0.6 called it TritonCompilerParams.
  params = getattr(pltriton, 'CompilerParams', None) or getattr(pltriton, 'TritonCompilerParams')
  return dict(compiler_params=params(num_warps=tile.num_warps, num_stages=tile.num_stages))


def _full(shape):
  """BlockSpec of a whole array (the kernels index into it themselves)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _forward(lhs_MK, rhs, starts_G, ends_G, tile, interpret, *, transpose_rhs=False, layer=None):
  """lhs @ rhs[g] per row ([G, K, N]; transpose_rhs: rhs [G, N, K], times rhs[g]^T); with layer,
  rhs is a stack [layers, G, ...] read at that layer. One kernel serves both: an unstacked rhs
  is a stack of one (a reshape, no copy). Dimensions not whole tiles are padded, which copies
  the rhs, a whole stack included (none at the MoE presets' shapes)."""
  if layer is None:
    rhs, layer = rhs[None], 0
  rows, depth = lhs_MK.shape
  width = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
  bm, bn, bk = _block(rows, tile.block_m), _block(width, tile.block_n), _block(depth, tile.block_k)
  rows_p, width_p, depth_p = _round_up(rows, bm), _round_up(width, bn), _round_up(depth, bk)
  lhs = _pad_to(_pad_to(lhs_MK, 0, rows_p), 1, depth_p)
  k_axis, n_axis = (3, 2) if transpose_rhs else (2, 3)
  rhs = _pad_to(_pad_to(rhs, k_axis, depth_p), n_axis, width_p)
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  tile_groups = _tile_groups(starts_G, ends_G, rows_p // bm, bm)
  out = pl.pallas_call(
    functools.partial(_gmm_kernel, block_k=bk, transpose_rhs=transpose_rhs),
    grid=(width_p // bn, rows_p // bm),
    in_specs=[
      pl.BlockSpec((None, 2), lambda j, i: (i, 0)),
      _full(starts_G.shape),
      _full(ends_G.shape),
      _full((1,)),
      _full(lhs.shape),
      _full(rhs.shape),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
    out_shape=jax.ShapeDtypeStruct((rows_p, width_p), lhs_MK.dtype),
    interpret=interpret,
    name='grouped_matmul_dlhs' if transpose_rhs else 'grouped_matmul_fwd',
    **_params(tile, interpret),
  )(tile_groups, starts_G, ends_G, layer_1, lhs, rhs)
  return out[:rows, :width]


def _transposed(lhs_MK, dout_MN, starts_G, ends_G, tile, interpret, dtype):
  """[G, K, N]: lhs[rows of g]^T @ d_out[rows of g] for every group g."""
  rows, depth = lhs_MK.shape
  width = dout_MN.shape[1]
  groups = starts_G.shape[0]
  bm, bn, bk = _block(rows, tile.block_m), _block(width, tile.block_n), _block(depth, tile.block_k)
  rows_p, width_p, depth_p = _round_up(rows, bm), _round_up(width, bn), _round_up(depth, bk)
  lhs = _pad_to(_pad_to(lhs_MK, 0, rows_p), 1, depth_p)
  dout = _pad_to(_pad_to(dout_MN, 0, rows_p), 1, width_p)
  out = pl.pallas_call(
    functools.partial(_tgmm_kernel, block_m=bm),
    grid=(width_p // bn, depth_p // bk, groups),
    in_specs=[_full(starts_G.shape), _full(ends_G.shape), _full(lhs.shape), _full(dout.shape)],
    out_specs=pl.BlockSpec((None, bk, bn), lambda j, k, g: (g, k, j)),
    out_shape=jax.ShapeDtypeStruct((groups, depth_p, width_p), dtype),
    interpret=interpret,
    name='grouped_matmul_drhs',
    **_params(tile, interpret),
  )(starts_G, ends_G, lhs, dout)
  return out[:, :depth, :width]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs_MK, rhs_GKN, group_sizes_G, tiles, interpret):
  starts, ends = _bounds(group_sizes_G, lhs_MK.shape[0])
  return _forward(lhs_MK, rhs_GKN, starts, ends, tiles.fwd, interpret)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, tiles, interpret):
  return _gmm(lhs_MK, rhs_GKN, group_sizes_G, tiles, interpret), (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(tiles, interpret, residuals, dout_MN):
  lhs_MK, rhs_GKN, group_sizes_G = residuals
  starts, ends = _bounds(group_sizes_G, lhs_MK.shape[0])
  dout_MN = dout_MN.astype(lhs_MK.dtype)
  dlhs = _forward(dout_MN, rhs_GKN, starts, ends, tiles.dlhs, interpret, transpose_rhs=True)
  drhs = _transposed(lhs_MK, dout_MN, starts, ends, tiles.drhs, interpret, rhs_GKN.dtype)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
