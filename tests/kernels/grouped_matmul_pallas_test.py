"""The Pallas grouped matmul (interpret mode here) against a plain numpy loop over the groups:
forward and both gradients, with 16-row tiles that straddle up to three groups, an empty group
inside a tile, rows past every group (NaN there must not leak), and dimensions that are not whole
tiles; and its Triton lowering at the Qwen3-30B-A3B expert shape."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.kernels import grouped_matmul_pallas as kernel

SMALL = kernel.Tile(16, 16, 16)
TILES = kernel.Tiles(SMALL, SMALL, SMALL)


def _reference(lhs, rhs, sizes, cot):
  """(out, d lhs, d rhs) of sum(out * cot), group by group in float64."""
  lhs, rhs, cot = (np.asarray(x, np.float64) for x in (lhs, rhs, cot))
  out, d_lhs, d_rhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, start + size)
    out[rows] = lhs[rows] @ rhs[g]
    d_lhs[rows] = cot[rows] @ rhs[g].T
    d_rhs[g] = lhs[rows].T @ cot[rows]
    start += size
  return out, d_lhs, d_rhs


@jax.jit
def _value_and_grads(lhs, rhs, sizes, cot):
  def loss(lhs, rhs):
    out = kernel.grouped_matmul(lhs, rhs, sizes, tiles=TILES, interpret=True)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  (_, out), (d_lhs, d_rhs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
  return out, d_lhs, d_rhs


@pytest.mark.parametrize(
  'dtype, sizes, rows',
  [
    # tile 0 meets groups 0, 1 (empty) and 2; tile 1 meets 2, 3 and 4; rows 34-39 in no group.
    (jnp.float32, [7, 0, 13, 5, 9], 40),
    (jnp.bfloat16, [7, 0, 13, 5, 9], 40),
    # empty first and last groups, a group over three tiles, every row in a group.
    (jnp.float32, [0, 3, 38, 8, 0], 49),
  ],
)
def test_matches_the_numpy_loop_forward_and_gradients(dtype, sizes, rows):
  keys = jax.random.split(jax.random.key(1), 3)
  depth, width = 24, 40  # neither a whole tile (padded inside), and unequal once padded
  total = sum(sizes)
  past = (jnp.arange(rows) >= total)[:, None]
  lhs = jnp.where(past, jnp.nan, jax.random.normal(keys[0], (rows, depth))).astype(dtype)
  rhs = jax.random.normal(keys[1], (len(sizes), depth, width)).astype(dtype)
  cot = jnp.where(past, jnp.nan, jax.random.normal(keys[2], (rows, width)))
  got = _value_and_grads(lhs, rhs, jnp.array(sizes), cot.astype(dtype))
  # The reference sees the very inputs the kernel saw (bf16 rounded), and cot rounded alike.
  want = _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, cot.astype(dtype))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for g, w, name in zip(got, want, ('out', 'd lhs', 'd rhs')):
    assert g.dtype == dtype, name
    g = np.asarray(g, np.float64)
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)
  assert not np.any(np.asarray(got[0])[total:]) and not np.any(np.asarray(got[1])[total:])


def test_bad_shapes_name_the_contract():
  with pytest.raises(ValueError, match=r'lhs \[M, K\] and rhs \[G, K, N\]'):
    kernel.grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 5, 6)), jnp.array([2, 2]))
  with pytest.raises(ValueError, match='one entry per group'):
    kernel.grouped_matmul(jnp.ones((4, 3)), jnp.ones((2, 3, 6)), jnp.array([4]))


@pytest.fixture
def verified_triton(monkeypatch):
  """The list of Triton modules lowered from here on, each passing MLIR's verifier (the GPU's
  compiler parses and verifies it; a loop whose bounds differ in type fails there only)."""
  from jax._src.pallas.triton import lowering  # pylint: disable=import-outside-toplevel

  verified = []
  lower_module = lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = lower_module(*args, **kwargs)
    result.module.operation.verify()  # raises with the failing op
    verified.append(result)
    return result

  monkeypatch.setattr(lowering, 'lower_jaxpr_to_triton_module', lower_and_verify)
  return verified


def _lower_for_cuda(fn, *args):
  try:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  except RuntimeError as e:
    if 'GPU' not in str(e):
      raise
    pytest.skip(f'this jax lowers Triton only with a GPU: {e}')


def test_forward_and_backward_lower_for_triton(verified_triton):
  """What a GPU compiles: the three kernels at Qwen3-30B-A3B's expert shape (2048 -> 768, 128
  experts, 16,384 tokens x top-8), bf16, each Triton module verified. jax releases that lower
  Triton only beside a GPU skip."""
  verified = verified_triton
  lhs = jax.ShapeDtypeStruct((131072, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
  cot = jax.ShapeDtypeStruct((131072, 768), jnp.bfloat16)

  def fwd_bwd(lhs, rhs, sizes, cot):
    out, vjp = jax.vjp(lambda a, b: kernel.grouped_matmul(a, b, sizes, interpret=False), lhs, rhs)
    return out, *vjp(cot)

  text = _lower_for_cuda(fwd_bwd, lhs, rhs, sizes, cot)
  for name in ('grouped_matmul_fwd', 'grouped_matmul_dlhs', 'grouped_matmul_drhs'):
    assert f'name = "{name}"' in text, name
  assert text.count('__gpu$xla.gpu.triton') == 3
  assert len(verified) == 3


def test_a_stacked_rhs_lowers_for_triton_and_reaches_the_kernel_whole(verified_triton):
  """The inference layout's read at LLaDA2.0-mini's shape (19 MoE layers x 256 experts, 2048 ->
  512, a batch-1 block of 32 tokens x top-8): the Triton module verifies, and the custom call's
  operand is the whole [19, 256, 2048, 512] stack with no slice of it before the call."""
  lhs = jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((19, 256, 2048, 512), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((256,), jnp.int32)
  layer = jax.ShapeDtypeStruct((), jnp.int32)

  def forward(lhs, rhs, sizes, layer):
    return kernel.grouped_matmul(lhs, rhs, sizes, layer=layer, interpret=False)

  text = _lower_for_cuda(forward, lhs, rhs, sizes, layer)
  assert text.count('__gpu$xla.gpu.triton') == 1 and len(verified_triton) == 1
  main = text[text.index('func.func public @main') :]
  main = main[: main.index('\n  }')].splitlines()[1:]  # the entry function's body
  body = [line for line in main if re.search(r'%arg1\b', line)]
  # rhs (%arg1) is read by the kernel call alone, as it was passed: no slice, pad or copy.
  assert len(body) == 1 and '__gpu$xla.gpu.triton' in body[0], body
  assert '%arg0, %arg1)' in body[0] and 'tensor<19x256x2048x512xbf16>' in body[0]


@pytest.mark.gpu
def test_gpu_bf16_matches_the_numpy_loop():
  """Triton kernels with the default tiles, uneven groups and an empty one, bf16."""
  sizes = [900, 0, 1531, 333, 1200, 4]
  rows, depth, width = 4096, 512, 384
  keys = jax.random.split(jax.random.key(2), 3)
  lhs = jax.random.normal(keys[0], (rows, depth), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (len(sizes), depth, width)) / depth**0.5).astype(jnp.bfloat16)
  cot = jax.random.normal(keys[2], (rows, width), jnp.bfloat16)

  @jax.jit
  def fwd_bwd(lhs, rhs, cot):
    out, vjp = jax.vjp(lambda a, b: kernel.grouped_matmul(a, b, jnp.array(sizes)), lhs, rhs)
    return out, *vjp(cot)

  got = fwd_bwd(lhs, rhs, cot)
  want = _reference(lhs, rhs.astype(jnp.float32), sizes, cot)
  for g, w in zip(got, want):
    g = np.asarray(g, np.float64)
    assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-2


def test_few_rows_per_expert_take_the_decode_tile():
  """A decode step (a batch-1 block of 32 tokens x top-8 over 256 experts: 256 rows) gets the
  16 x 64 decode tile; a training batch (16,384 tokens x top-8 over 128) the default; a tile the
  caller names wins."""
  assert kernel.forward_tile(256, 256, None) == kernel.DECODE_FWD
  assert kernel.forward_tile(16 * 256, 256, None) == kernel.DECODE_FWD
  assert kernel.forward_tile(16 * 256 + 1, 256, None) == kernel.Tiles().fwd
  assert kernel.forward_tile(131072, 128, None) == kernel.Tiles().fwd
  assert kernel.forward_tile(256, 256, TILES) == SMALL


def test_the_decode_tile_matches_the_numpy_loop_on_a_stacked_rhs():
  """The inference path with the tile it picks itself: few rows over many groups (some empty),
  one layer of a stack read in place, K and N not whole decode tiles."""
  sizes = [2, 0, 1, 3, 0, 0, 4, 1]
  rows, depth, width = 13, 136, 72  # row 12 in no group
  keys = jax.random.split(jax.random.key(3), 2)
  lhs = jax.random.normal(keys[0], (rows, depth))
  stack = jax.random.normal(keys[1], (3, len(sizes), depth, width))
  assert kernel.forward_tile(rows, len(sizes), None) == kernel.DECODE_FWD
  got = jax.jit(
    lambda a, b, layer: kernel.grouped_matmul(a, b, jnp.array(sizes), layer=layer, interpret=True)
  )(lhs, stack, 2)
  want = _reference(lhs, stack[2], sizes, np.zeros((rows, width)))[0]
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_gpu_decode_tile_matches_the_numpy_loop():
  """The decode tile in Triton at LLaDA2.0-mini's expert shape: 256 rows over 256 experts."""
  rng = np.random.default_rng(4)
  sizes = np.bincount(rng.integers(0, 256, 256), minlength=256).tolist()
  keys = jax.random.split(jax.random.key(4), 2)
  lhs = jax.random.normal(keys[0], (256, 2048), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (256, 2048, 512)) / 2048**0.5).astype(jnp.bfloat16)
  got = jax.jit(lambda a, b: kernel.grouped_matmul(a, b, jnp.array(sizes)))(lhs, rhs)
  want = _reference(lhs, rhs.astype(jnp.float32), sizes, np.zeros((256, 512)))[0]
  g = np.asarray(got, np.float64)
  assert np.linalg.norm(g - want) / np.linalg.norm(want) < 1e-2
