"""The Pallas flash attention against `xla_attention`: outputs, gradients, tile skipping, sharding.

On CPU the kernels run in Pallas interpret mode (tiny shapes: each case compiles in ~10 s); the
`gpu` tests run the Triton lowering in bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from dlmjax import config as config_lib
from dlmjax.kernels import flash_attention as fa
from dlmjax.kernels import flash_masks as fm
from dlmjax.model import attention as attention_lib
from dlmjax.parallel import rules
from tests.conftest import tiny_test_config

# Unequal query / key tiles, so a wrong index on either side shows.
SMALL = fa.Tiles(fwd=fa.Tile(16, 8), dq=fa.Tile(8, 16), dkv=fa.Tile(16, 8))
# Interpret-mode programs are long loops of small ops: XLA's optimisations cost compile time here
# (about a third) and buy nothing at these sizes.
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


@pytest.fixture(autouse=True)
def _strict_ranks():
  with jax.numpy_rank_promotion('raise'):
    yield


def documents(key, batch, length, docs):
  """Segment ids of `docs` contiguous documents of random lengths per row."""
  cuts = jnp.sort(jax.random.randint(key, (batch, docs - 1), 1, length), -1)
  return (jnp.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(jnp.int32)


def make_case(
  seed, *, batch, length, heads, kv_heads, head_dim, docs=0, valid=None, dtype=jnp.float32
):
  k = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dtype)
  kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(k[3], q.shape, jnp.float32).astype(dtype)
  seg = documents(k[4], batch, length, docs) if docs else None
  valid = None if valid is None else jnp.asarray(valid, jnp.int32)
  return q, kk, v, do, seg, valid


def value_and_grads(attend, q, k, v, do):
  def run(q, k, v, do):
    o, vjp = jax.vjp(attend, q, k, v)
    return (o, *vjp(do))

  options = FAST_COMPILE if jax.default_backend() == 'cpu' else None
  return jax.jit(run).lower(q, k, v, do).compile(compiler_options=options)(q, k, v, do)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize(
  'kind, heads, kv_heads, length, docs, valid',
  [
    ('causal', 4, 2, 32, 3, 'cut'),  # GQA, documents, padding: rows that see no key.
    ('block_causal', 2, 2, 40, 2, None),  # 40 is no multiple of the tile: padded inside.
  ],
)  # The mask-free path (plain bidirectional) is test_sharded_matches_reference's.
def test_matches_reference(kind, heads, kv_heads, length, docs, valid):
  q, k, v, do, seg, valid = make_case(
    0, batch=2, length=length, heads=heads, kv_heads=kv_heads, head_dim=16, docs=docs, valid=None
  )
  if valid == 'cut':  # Row 0 ends before its last document starts: that document sees nothing.
    valid = jnp.array([int(jnp.argmax(seg[0] == seg[0].max())), length - 3], jnp.int32)
  kw = dict(kind=kind, block_size=8, segment_ids_BL=seg, valid_length_B=valid)
  sees_BL = np.asarray(attention_lib.attention_mask(length, **kw).any(-1))
  live = sees_BL[:, :, None, None]
  do = jnp.where(live, do, 0.0)  # The reference's output on rows that see nothing is arbitrary.
  got = value_and_grads(lambda q, k, v: fa.flash_attention(q, k, v, tiles=SMALL, **kw), q, k, v, do)
  want = value_and_grads(lambda q, k, v: attention_lib.xla_attention(q, k, v, **kw), q, k, v, do)
  np.testing.assert_allclose(np.where(live, got[0], 0), np.where(live, want[0], 0), atol=2e-5)
  for name, g, w in zip(('dq', 'dk', 'dv'), got[1:], want[1:]):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4, err_msg=name)
  assert (valid is None) == sees_BL.all()  # the padded case really has blind rows ...
  assert np.all(np.asarray(got[0])[~np.broadcast_to(live, got[0].shape)] == 0)  # ... output 0.


def bd3lm_mask(half, block_size, seg_L=None, valid=None):
  """BD3LM's mask over [x_t || x_0] written out: M_BD | M_OBC | M_BC, then documents, lengths.

  With documents (the same ids in both streams), blocks count from each document's first
  in-stream index, as SDAR aligns them to each packed sample."""
  n = 2 * half
  ids = np.zeros(half, int) if seg_L is None else np.asarray(seg_L)[:half]
  first = {d: int(np.flatnonzero(ids == d)[0]) for d in set(ids.tolist())}
  mask = np.zeros((n, n), bool)
  for q in range(n):
    for k in range(n):
      fq, fk = q >= half, k >= half
      iq, ik = q - half * fq, k - half * fk
      bq, bk = (iq - first[ids[iq]]) // block_size, (ik - first[ids[ik]]) // block_size
      diagonal = bq == bk and fq == fk
      offset = bq > bk and fk and not fq
      clean = bq >= bk and fk and fq
      mask[q, k] = (diagonal or offset or clean) and (valid is None or ik < valid)
      mask[q, k] &= ids[iq] == ids[ik]
  return mask


def test_two_stream_matches_reference_and_the_written_out_mask():
  """Forward and gradients on [x_t || x_0]: 2 x 12 positions (padded to whole tiles inside, so a
  key tile spans the stream boundary), GQA, documents in both streams that start off the block
  grid (blocks count from each one's start), row 0 cut to 9 tokens per stream."""
  half, block = 12, 4
  q, k, v, do, _, _ = make_case(5, batch=2, length=2 * half, heads=2, kv_heads=1, head_dim=16)
  seg_half = jnp.array([[1] * 5 + [2] * 7, [1] * 3 + [2] * 6 + [3] * 3], jnp.int32)
  seg = jnp.concatenate([seg_half, seg_half], axis=1)
  valid = jnp.array([9, half], jnp.int32)
  kw = dict(kind='two_stream', block_size=block, segment_ids_BL=seg, valid_length_B=valid)
  visible = np.asarray(attention_lib.attention_mask(2 * half, **kw))
  for b in range(2):
    ids = np.asarray(seg[b])
    want = bd3lm_mask(half, block, ids, int(valid[b]))
    np.testing.assert_array_equal(visible[b], want)
    row_grid = bd3lm_mask(half, block, valid=int(valid[b])) & (ids[:, None] == ids[None, :])
    assert (want != row_grid).any()  # a grid from the row's start would be another mask
  live = visible.any(-1)[:, :, None, None]
  do = jnp.where(live, do, 0.0)
  got = value_and_grads(lambda q, k, v: fa.flash_attention(q, k, v, tiles=SMALL, **kw), q, k, v, do)
  want = value_and_grads(lambda q, k, v: attention_lib.xla_attention(q, k, v, **kw), q, k, v, do)
  np.testing.assert_allclose(np.where(live, got[0], 0), np.where(live, want[0], 0), atol=2e-5)
  for name, g, w in zip(('dq', 'dk', 'dv'), got[1:], want[1:]):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4, err_msg=name)


def brute_live(kind, block_size, seg, valid, block_q, block_k):
  """Tile (i, j) is live iff some query of tile i sees some key of tile j."""
  length = 64
  vis = np.asarray(
    attention_lib.attention_mask(
      length, kind=kind, block_size=block_size, segment_ids_BL=seg, valid_length_B=valid
    )
  )
  b = valid.shape[0]
  return vis.reshape(b, length // block_q, block_q, length // block_k, block_k).any((2, 4))


@pytest.mark.parametrize('kind', fa.MASK_KINDS)
@pytest.mark.parametrize('segments', [False, True])
def test_loops_skip_blind_tiles_and_keep_seen_ones(kind, segments):
  """Loop bounds keep every tile someone sees; without documents they skip all the others."""
  batch, length, block_q, block_k = 3, 64, 16, 8
  half = length // 2 if kind == 'two_stream' else 0  # two_stream: [x_t || x_0] of 32 each
  seg = documents(jax.random.key(1), batch, half or length, 4)
  seg = jnp.concatenate([seg, seg], axis=1) if half else seg  # the same documents in both
  valid = jnp.array([64, 41, 9], jnp.int32)
  mask = fm._Mask(kind, 4, segments=segments, lengths=True, half=half)
  ids = fa.document_keys(seg, 4, half=half) if mask.per_document else seg  # as the kernel reads
  live = np.asarray(fm._live_tiles(mask, ids, valid, block_q, block_k))
  want = brute_live(kind, 4, seg if segments else None, valid, block_q, block_k)
  if segments:  # id ranges per tile: a superset (a tile may hold ids 1 and 3 but not 2).
    assert np.all(live >= want) and live.sum() < 1.2 * want.sum()
  else:
    np.testing.assert_array_equal(live, want)
  ranges = np.asarray(fm._ranges(jnp.asarray(live), valid))
  second_runs = 0
  for b in range(batch):
    for i in range(live.shape[1]):
      lo, hi, _, lo2, hi2 = ranges[b, i, :5]
      cols = np.flatnonzero(live[b, i])
      assert lo == (cols[0] if cols.size else 0) and np.all(live[b, i, lo:hi])
      # The loops visit exactly the live tiles (every mask here has at most two runs a row).
      assert sorted({*range(lo, hi), *range(lo2, hi2)}) == cols.tolist()
      second_runs += hi2 > lo2
  assert ranges[..., 2].tolist() == [[int(x)] * live.shape[1] for x in valid]
  assert live.sum() < live.size  # something is skipped
  # A noisy block's tiles skip the noisy tiles between its own and the clean ones it sees.
  assert (second_runs > 0) == (kind == 'two_stream')


def test_sharded_matches_reference():
  """Under an 8-device activation mesh the pallas backend runs per shard via shard_map.

  Plain bidirectional attention: the kernels' mask-free path, forward and backward.
  """
  q, k, v, do, _, _ = make_case(2, batch=4, length=16, heads=4, kv_heads=2, head_dim=16)
  devices = np.array(jax.devices()[:8]).reshape(1, 2, 2, 1, 1, 2)
  mesh = Mesh(devices, config_lib.MESH_AXES)

  def sharded(q, k, v):
    with rules.activation_mesh(mesh):
      return attention_lib.pallas_attention(q, k, v, kind='bidirectional')

  assert 'shard_map' in str(jax.make_jaxpr(sharded)(q, k, v))
  got = value_and_grads(sharded, q, k, v, do)
  want = value_and_grads(
    lambda q, k, v: attention_lib.xla_attention(q, k, v, kind='bidirectional'), q, k, v, do
  )
  for name, g, w in zip(('o', 'dq', 'dk', 'dv'), got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4, err_msg=name)


def test_bad_inputs_name_the_problem():
  q, k, v, *_ = make_case(0, batch=1, length=16, heads=3, kv_heads=2, head_dim=16)
  with pytest.raises(ValueError, match='kv head groups'):
    fa.flash_attention(q, k, v, kind='bidirectional')
  with pytest.raises(ValueError, match='unknown attention mask kind'):
    fa.flash_attention(k, k, v, kind='sliding')
  with pytest.raises(ValueError, match='block_size'):
    fa.flash_attention(k, k, v, kind='block_causal')
  with pytest.raises(ValueError, match='must be'):
    fa.flash_attention(k, k[:, :8], v[:, :8], kind='causal')
  with pytest.raises(ValueError, match='power-of-two head_dim'):
    fa.flash_attention(k[..., :12], k[..., :12], v[..., :12], kind='causal', interpret=False)


def test_config_accepts_pallas_and_auto_and_checks_head_dim():
  for backend in ('pallas', 'auto'):
    config_lib.validate(
      tiny_test_config(
        **{
          'model.attention_backend': backend,
          'model.attention_mask': 'block_causal',
          'data.packing': True,
        }
      )
    )
  with pytest.raises(config_lib.ConfigError, match='power-of-two model.head_dim'):
    config_lib.validate(
      tiny_test_config(**{'model.attention_backend': 'pallas', 'model.head_dim': 24})
    )


def test_auto_is_xla_off_gpu():
  q, k, v, *_ = make_case(3, batch=1, length=16, heads=2, kv_heads=1, head_dim=16, docs=2)
  if jax.default_backend() == 'gpu':
    pytest.skip('CPU rule')
  np.testing.assert_array_equal(
    attention_lib.auto_attention(q, k, v, kind='causal'),
    attention_lib.xla_attention(q, k, v, kind='causal'),
  )


@pytest.mark.gpu
@pytest.mark.parametrize('kind', fa.MASK_KINDS)
def test_gpu_bf16_matches_reference(kind):
  """Triton lowering, bf16 in / f32 accumulate, against the f32 reference on the same inputs."""
  q, k, v, do, seg, valid = make_case(
    4,
    batch=2,
    length=384,
    heads=4,
    kv_heads=2,
    head_dim=64,
    docs=3,
    valid=[384, 301],
    dtype=jnp.bfloat16,
  )
  if kind == 'two_stream':  # [x_t || x_0]: both streams hold the same documents
    seg = jnp.concatenate([seg[:, :192], seg[:, :192]], axis=1)
  kw = dict(kind=kind, block_size=64, segment_ids_BL=seg, valid_length_B=valid)
  live = np.asarray(attention_lib.attention_mask(384, **kw).any(-1))[:, :, None, None]
  do = jnp.where(live, do, 0)
  got = value_and_grads(lambda q, k, v: fa.flash_attention(q, k, v, **kw), q, k, v, do)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = value_and_grads(lambda q, k, v: attention_lib.xla_attention(q, k, v, **kw), *f32)
  assert rel_err(np.where(live, got[0].astype(jnp.float32), 0), np.where(live, want[0], 0)) < 1e-2
  for g, w in zip(got[1:], want[1:]):
    assert rel_err(g.astype(jnp.float32), w) < 1e-2
  auto = attention_lib.auto_attention(q, k, v, **kw)
  assert rel_err(np.where(live, auto.astype(jnp.float32), 0), np.where(live, want[0], 0)) < 1e-2


@pytest.mark.parametrize('kind', fa.SLICE_KINDS)
def test_slice_kernel_matches_reference(kind):
  """A cached forward's attention: 9 queries (padded to 16 inside) from a traced start against
  40 keys (padded to 48: a length mask), GQA 2:1 (two heads' queries share a program's rows),
  left padding as segment ids and ragged valid lengths; three starts through one compile."""
  batch, length, num_queries = 2, 40, 9
  keys = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(keys[0], (batch, num_queries, 4, 16), jnp.float32)
  k, v = (jax.random.normal(key, (batch, length, 2, 16), jnp.float32) for key in keys[1:])
  seg = (jnp.arange(length)[None] >= jnp.array([[0], [5]])).astype(jnp.int32)  # row 1: 5 pads
  kw = dict(kind=kind, block_size=4, segment_ids_BL=seg, valid_length_B=jnp.array([length, 30]))
  tile = fa.Tile(16, 16)
  run = jax.jit(lambda s: fa.flash_attention_slice(q, k, v, query_start=s, tile=tile, **kw))
  run = run.lower(jnp.int32(0)).compile(compiler_options=FAST_COMPILE)
  for start in (0, 13, 31):  # 31: the last queries lie past row 1's valid length.
    got = np.asarray(run(jnp.int32(start)))
    want = attention_lib.xla_attention(q, k, v, query_start=start, **kw)
    sees = np.asarray(
      attention_lib.attention_mask(length, query_start=start, num_queries=num_queries, **kw)
    ).any(-1)[:, :, None, None]
    np.testing.assert_allclose(np.where(sees, got, 0), np.where(sees, want, 0), atol=2e-6)
    assert np.all(got[~np.broadcast_to(sees, got.shape)] == 0)  # rows that see nothing: 0
  # Without documents the loops visit exactly the key tiles some row of the tile sees.
  mask = fm._Mask(kind, 4, segments=False, lengths=True)
  rows, block = 2 * 16, 8
  positions = 13 + jnp.arange(rows) % 16
  seg_rows, seg_keys = jnp.zeros((batch, rows), jnp.int32), jnp.zeros((batch, length), jnp.int32)
  valid = kw['valid_length_B']
  live = np.asarray(fm._slice_live_tiles(mask, positions, seg_rows, seg_keys, valid, 16, block))
  q_pos = np.asarray(positions).reshape(2, 16)
  k_pos = np.arange(length)
  vis = {'bidirectional': np.ones((2, 16, length), bool)}.get(kind)
  if vis is None:
    div = 1 if kind == 'causal' else 4
    vis = q_pos[:, :, None] // div >= k_pos[None, None] // div
  want = vis[None] & (k_pos < np.asarray(valid)[:, None, None, None])
  np.testing.assert_array_equal(
    live, want.reshape(batch, 2, 16, length // block, block).any((2, 4))
  )
  assert live.sum() < live.size  # something is skipped (row 1's keys past 30, at least)


@pytest.mark.gpu
@pytest.mark.parametrize('kind', fa.SLICE_KINDS)
def test_gpu_slice_kernel_bf16_matches_reference(kind):
  """The slice kernel's Triton lowering at the sampler's shape (a 33-query block, Dream's lead
  row included, against 320 keys, GQA 2:1, left padding), bf16 against the f32 reference."""
  keys = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(keys[0], (4, 33, 4, 128), jnp.float32).astype(jnp.bfloat16)
  k, v = (
    jax.random.normal(x, (4, 320, 2, 128), jnp.float32).astype(jnp.bfloat16) for x in keys[1:]
  )
  seg = (jnp.arange(320)[None] >= jnp.array([[0], [7], [30], [63]])).astype(jnp.int32)
  kw = dict(kind=kind, block_size=32, segment_ids_BL=seg, query_start=95)
  got = jax.jit(lambda q, k, v: fa.flash_attention_slice(q, k, v, **kw))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  assert rel_err(got.astype(jnp.float32), attention_lib.xla_attention(*f32, **kw)) < 1e-2


def _cached_case(seed, *, layers, batch, length, num_queries, heads, kv_heads, head_dim, dtype):
  """q [B, Q, N, H], the slice's fresh k, v [B, Q, K, H], stacked caches [layers, B, S, K, H]."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, num_queries, heads, head_dim), jnp.float32)
  fresh = (batch, num_queries, kv_heads, head_dim)
  cache = (layers, batch, length, kv_heads, head_dim)
  k, v = (jax.random.normal(key, fresh, jnp.float32) for key in keys[1:3])
  k_cache, v_cache = (jax.random.normal(key, cache, jnp.float32) for key in keys[3:])
  return tuple(x.astype(dtype) for x in (q, k, v, k_cache, v_cache))


def _written_in(cache, fresh, layer, start):
  """The reference's keys: the layer's cache with the fresh rows written in at start."""
  return jax.lax.dynamic_update_slice_in_dim(cache[layer], fresh.astype(cache.dtype), start, 1)


@pytest.mark.parametrize(
  'kind,masked',
  [(kind, True) for kind in fa.SLICE_KINDS] + [('bidirectional', False)],
  ids=[*fa.SLICE_KINDS, 'bidirectional_unmasked'],
)
def test_cached_slice_kernel_reads_the_cache_in_place(kind, masked):
  """flash_attention_slice_cached equals xla_attention on the layer's cache with the fresh K/V
  written in: 9 fresh queries and keys (GQA 2:1), 40 keys (no multiple of the 16-key tile: the
  last tile is read shifted), starts 0, inside two tiles and at the end (31), two layers of
  three, all through one compile; masked: left padding as segment ids and ragged lengths
  (unmasked: the kernel's no-dense-mask path, where only the fresh positions are masked)."""
  shape = dict(layers=3, batch=2, length=40, num_queries=9, heads=4, kv_heads=2, head_dim=16)
  q, k, v, k_cache, v_cache = _cached_case(9, dtype=jnp.float32, **shape)
  kw = dict(kind=kind, block_size=4)
  if masked:
    seg = (jnp.arange(40)[None] >= jnp.array([[0], [5]])).astype(jnp.int32)  # row 1: 5 pads
    kw.update(segment_ids_BL=seg, valid_length_B=jnp.array([40, 30]))

  def attend(start, layer):
    return fa.flash_attention_slice_cached(
      q, k, v, k_cache, v_cache, layer, query_start=start, tile=fa.Tile(16, 16), **kw
    )

  run = jax.jit(attend).lower(jnp.int32(0), jnp.int32(0)).compile(compiler_options=FAST_COMPILE)
  for start in (0, 13, 31):
    for layer in (0, 2):
      got = np.asarray(run(jnp.int32(start), jnp.int32(layer)))
      keys = (_written_in(k_cache, k, layer, start), _written_in(v_cache, v, layer, start))
      want = attention_lib.xla_attention(q, *keys, query_start=start, **kw)
      sees = np.asarray(
        attention_lib.attention_mask(40, query_start=start, num_queries=9, **kw)
      ).any(-1)[:, :, None, None]
      np.testing.assert_allclose(np.where(sees, got, 0), np.where(sees, want, 0), atol=2e-6)
      assert np.all(got[~np.broadcast_to(sees, got.shape)] == 0)  # rows that see nothing: 0


def test_cached_slice_attention_backends_agree():
  """attention.cached_slice_attention: pallas (the in-place kernel) and xla (the copying path)
  give the same output, with default tiles (64-key tiles shrunk to the 24-key cache) and a
  cache shorter than one 16-key tile (the kernel's copying fallback)."""
  for length, start in ((24, 7), (12, 3)):
    shape = dict(layers=2, batch=2, length=length, num_queries=5, heads=4, kv_heads=2, head_dim=16)
    q, k, v, k_cache, v_cache = _cached_case(10, dtype=jnp.float32, **shape)
    kw = dict(kind='causal', valid_length_B=jnp.array([length, length - 2]), query_start=start)
    got, want = (
      attention_lib.cached_slice_attention(
        q, k, v, k_cache, v_cache, jnp.int32(1), backend=backend, **kw
      )
      for backend in ('pallas', 'xla')
    )
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_cached_slice_kernel_lowers_to_one_triton_call_on_the_whole_cache():
  """Lowered for CUDA (no GPU needed), a layer scan over the in-place kernel hands the Triton
  call the whole stacked caches and cuts no per-layer copy of them: the only dynamic slice is
  the layer index's."""
  layers, batch, length = 4, 2, 320
  shapes = [(batch, 33, 4, 128), (batch, 33, 2, 128), (batch, 33, 2, 128)]
  shapes += [(layers, batch, length, 2, 128)] * 2
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]

  def scan(q, k, v, k_cache, v_cache):
    def body(x, layer):
      kw = dict(kind='bidirectional', query_start=95, interpret=False)
      return fa.flash_attention_slice_cached(x, k, v, k_cache, v_cache, layer, **kw), None

    return jax.lax.scan(body, q, jnp.arange(layers))[0]

  text = jax.jit(scan).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  calls = [line for line in text.splitlines() if 'xla.gpu.triton' in line]
  assert len(calls) == 1 and 'tensor<4x2x320x2x128xbf16>' in calls[0].rsplit(' -> ', 1)[0]
  sliced = [
    line for line in text.splitlines() if 'dynamic_slice' in line or 'dynamic_update' in line
  ]
  assert all('2x320x2x128' not in line for line in sliced), sliced


@pytest.mark.gpu
@pytest.mark.parametrize('kind', fa.SLICE_KINDS)
@pytest.mark.parametrize('length', [320, 328])
def test_gpu_cached_slice_kernel_bf16_matches_reference(kind, length):
  """The in-place kernel's Triton lowering at the sampler's shape (a 33-query block against 320
  keys, or 328: a shifted last 64-key tile), GQA 2:1, left padding, layer 2 of 4, bf16 against
  the f32 reference on the layer's cache with the fresh K/V written in."""
  shape = dict(layers=4, batch=4, length=length, num_queries=33, heads=4, kv_heads=2, head_dim=128)
  q, k, v, k_cache, v_cache = _cached_case(11, dtype=jnp.bfloat16, **shape)
  seg = (jnp.arange(length)[None] >= jnp.array([[0], [7], [30], [63]])).astype(jnp.int32)
  kw = dict(kind=kind, block_size=32, segment_ids_BL=seg, query_start=95)
  run = jax.jit(lambda *a: fa.flash_attention_slice_cached(*a, jnp.int32(2), **kw))
  got = run(q, k, v, k_cache, v_cache)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, k_cache, v_cache)]
  keys = (_written_in(f32[3], f32[1], 2, 95), _written_in(f32[4], f32[2], 2, 95))
  want = attention_lib.xla_attention(f32[0], *keys, **kw)
  assert rel_err(got.astype(jnp.float32), want) < 1e-2
