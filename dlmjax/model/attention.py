"""Self-attention: the Qwen3-style module (QK-norm before RoPE, GQA; QK-norm off and q/k/v biases
on for Qwen2 and Llama) and its backends.

Backends share one signature so a config switch picks them: `xla` (plain einsums, every mask,
every device), `cudnn` (jax.nn.dot_product_attention, GPU; bidirectional or causal plus
padding lengths, never a dense mask), `pallas` (our flash kernels, every mask without a dense
one: the Mosaic GPU kernel for plain bidirectional attention on Hopper, the Triton kernel for the
rest; interpret mode off GPU) and `auto` (the fastest valid one, by the rule in auto_attention).
A cached forward's slice (fewer queries than keys) takes slice_attention's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dlmjax.kernels import flash_attention
from dlmjax.kernels import flash_attention_mgpu
from dlmjax.model import choices, layers, lora
from dlmjax.parallel import rules

MASKS = choices.ATTENTION_MASKS  # model.attention_mask
MASK_KINDS = (*MASKS, 'two_stream')
# two_stream is not a model.attention_mask: the block-diffusion objective runs a block_causal model
# on [x_t || x_0] with it (Transformer.hidden's clean_BL; docs/block_diffusion.md).
_NEG_INF = -1e30  # finite, so a fully masked (padding) row stays NaN-free.


def attention_mask(
  length: int,
  *,
  kind: str,
  block_size: int = 0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
  num_queries: int | None = None,
):
  """Boolean visibility [B or 1, Q(query), L(key)] for a mask kind, documents and padding.

  The queries are positions [query_start, query_start + num_queries) of the L keys (all L by
  default): a cached forward over a slice of the sequence (Attention's kv_cache) sees what those
  positions see in the whole-sequence mask. query_start may be traced; segment ids cover the keys.
  With segment ids, block_causal and two_stream blocks count from each document's start, as SDAR
  trains packed samples; a document is then a run of equal ids (a repeated id starts another one,
  as in the flash kernel's document_keys; docs/block_diffusion.md, Packed documents).
  """
  num_queries = length if num_queries is None else num_queries
  q = query_start + jnp.arange(num_queries)[None, :, None]  # [1, Q, 1]
  k = jnp.arange(length)[None, None, :]  # [1, 1, L]
  q_start = k_start = 0  # where each position's block grid starts (in its stream)
  per_document = segment_ids_BL is not None and kind in ('block_causal', 'two_stream')
  if per_document:
    half = length // 2 if kind == 'two_stream' else 0
    starts_BL = flash_attention.document_starts(segment_ids_BL, half)
    k_start = starts_BL[:, None, :]
    q_start = jax.lax.dynamic_slice_in_dim(starts_BL, query_start, num_queries, axis=1)[..., None]
  if kind == 'bidirectional':
    visible = jnp.ones((1, num_queries, length), bool)
  elif kind == 'causal':
    visible = q >= k
  elif kind == 'block_causal':  # bidirectional inside a block, causal across blocks (BD3LM).
    visible = (q - q_start) // block_size >= (k - k_start) // block_size
  elif kind == 'two_stream':
    visible = flash_attention.two_stream_visible(
      q, k, half=length // 2, block_size=block_size, q_offset=q_start, k_offset=k_start
    )
  else:
    raise ValueError(f'unknown attention mask kind {kind!r}; known: {MASK_KINDS}')
  if per_document:  # one run of ids is one document
    visible = visible & (q_start == k_start)
  if segment_ids_BL is not None:
    query_ids_BQ = jax.lax.dynamic_slice_in_dim(segment_ids_BL, query_start, num_queries, axis=1)
    visible = visible & (query_ids_BQ[:, :, None] == segment_ids_BL[:, None, :])
  if valid_length_B is not None:
    local_k = flash_attention.stream_index(k, length // 2) if kind == 'two_stream' else k
    visible = visible & (local_k < valid_length_B[:, None, None])
  return visible


def xla_attention(
  q_BQNH,
  k_BLKH,
  v_BLKH,
  *,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
):
  """Reference attention: fp32 softmax over einsum logits; grouped heads share K/V.

  q may be shorter than k (a cached forward): its rows are key positions from query_start on.
  """
  batch, num_queries, num_heads, head_dim = q_BQNH.shape
  length, num_kv = k_BLKH.shape[1], k_BLKH.shape[2]
  q_BQKGH = q_BQNH.reshape(batch, num_queries, num_kv, num_heads // num_kv, head_dim)
  logits = jnp.einsum('blkgh,bskh->bkgls', q_BQKGH, k_BLKH, preferred_element_type=jnp.float32)
  logits = logits * (head_dim**-0.5)
  visible = attention_mask(
    length,
    kind=kind,
    block_size=block_size,
    segment_ids_BL=segment_ids_BL,
    valid_length_B=valid_length_B,
    query_start=query_start,
    num_queries=num_queries,
  )
  logits = jnp.where(visible[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BLKH.dtype)
  out = jnp.einsum('bkgls,bskh->blkgh', probs, v_BLKH)
  return out.reshape(batch, num_queries, num_heads, head_dim)


def cudnn_attention(
  q_BLNH, k_BLKH, v_BLKH, *, kind, block_size=0, segment_ids_BL=None, valid_length_B=None
):
  """cuDNN flash attention. Refuses what it could only do through a slow dense mask."""
  del block_size
  if kind in ('block_causal', 'two_stream') or segment_ids_BL is not None:
    raise ValueError(
      'the cudnn attention backend supports bidirectional and causal masks with '
      'padding only; use model.attention_backend=pallas (or xla) for block_causal, '
      'the block-diffusion objective or segments.'
    )
  lengths = None
  if valid_length_B is not None:
    lengths = valid_length_B.astype(jnp.int32)
  return jax.nn.dot_product_attention(
    q_BLNH,
    k_BLKH,
    v_BLKH,
    is_causal=(kind == 'causal'),
    query_seq_lengths=lengths,
    key_value_seq_lengths=lengths,
    implementation='cudnn',
  )


def pallas_attention(
  q_BLNH, k_BLKH, v_BLKH, *, kind, block_size=0, segment_ids_BL=None, valid_length_B=None
):
  """The Pallas flash kernel; under an activation mesh it runs per shard (batch and heads)."""

  def attend(q, k, v, seg, valid):
    if (
      kind == 'bidirectional'
      and seg is None
      and _on_hopper()
      and flash_attention_mgpu.supported(q.shape, k.shape, q.dtype) is None
    ):
      return flash_attention_mgpu.flash_attention_mgpu(q, k, v, valid_length_B=valid)
    return flash_attention.flash_attention(
      q, k, v, kind=kind, block_size=block_size, segment_ids_BL=seg, valid_length_B=valid
    )

  heads = (rules.BATCH, None, rules.ATTN_HEADS, None)
  return rules.per_shard(
    attend,
    (q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, valid_length_B),
    (heads, heads, heads, (rules.BATCH, None), (rules.BATCH,)),
    heads,
  )


def _on_hopper() -> bool:
  """Mosaic GPU's wgmma path needs compute capability 9.x (sm90a)."""
  device = jax.devices()[0]
  return device.platform == 'gpu' and str(getattr(device, 'compute_capability', '')).startswith('9')


def auto_attention(
  q_BLNH, k_BLKH, v_BLKH, *, kind, block_size=0, segment_ids_BL=None, valid_length_B=None
):
  """The fastest valid backend, measured on an H200 (docs/benchmarks.md, Flash attention).

  cuDNN wherever it needs no dense mask (bidirectional or causal, padding lengths): it led the
  Mosaic GPU kernel by 1.04x in forward + backward alone and by 1.05x in the 1.7B step
  (bidirectional), the Triton kernel by 1.21x (causal). The Pallas kernel for documents (segment
  ids) and block_causal, where cuDNN needs a dense mask and took 2.4x (4 documents) and 2.0x
  (block_causal) the kernel's time. XLA off GPU.
  """
  head_dim = q_BLNH.shape[-1]
  if jax.default_backend() != 'gpu':
    backend = xla_attention
  elif (
    kind in ('bidirectional', 'causal')
    and segment_ids_BL is None
    and head_dim % 8 == 0
    and head_dim <= 256
  ):
    backend = cudnn_attention
  elif flash_attention.supports_head_dim(head_dim):
    backend = pallas_attention
  else:
    backend = xla_attention
  return backend(
    q_BLNH,
    k_BLKH,
    v_BLKH,
    kind=kind,
    block_size=block_size,
    segment_ids_BL=segment_ids_BL,
    valid_length_B=valid_length_B,
  )


def _slice_kernel_serves(backend, kind, head_dim) -> bool:
  """Whether a slice runs the slice kernels: pallas, and auto on GPU, for the masks and head
  dims they take."""
  fits = kind in flash_attention.SLICE_KINDS and flash_attention.supports_head_dim(head_dim)
  return fits and (backend == 'pallas' or (backend == 'auto' and jax.default_backend() == 'gpu'))


def slice_attention(
  q_BQNH,
  k_BSKH,
  v_BSKH,
  *,
  backend,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
):
  """A cached forward's attention: Q queries (the positions from query_start) against S > Q
  keys. pallas, and auto on GPU, run the slice kernel (flash_attention_slice: the grouped heads
  share each K/V tile, blind key tiles skipped; docs/benchmarks.md, Sampler); xla, cudnn (it
  has no offset queries) and auto elsewhere run xla_attention."""
  mask = dict(kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL)
  if _slice_kernel_serves(backend, kind, q_BQNH.shape[-1]):

    def attend(q, k, v, seg, valid, start):
      return flash_attention.flash_attention_slice(
        q, k, v, valid_length_B=valid, query_start=start, **dict(mask, segment_ids_BL=seg)
      )

    heads = (rules.BATCH, None, rules.ATTN_HEADS, None)
    return rules.per_shard(
      attend,
      (q_BQNH, k_BSKH, v_BSKH, segment_ids_BL, valid_length_B, jnp.asarray(query_start)),
      (heads, heads, heads, (rules.BATCH, None), (rules.BATCH,), ()),
      heads,
    )
  return xla_attention(
    q_BQNH, k_BSKH, v_BSKH, valid_length_B=valid_length_B, query_start=query_start, **mask
  )


def cached_slice_attention(
  q_BQNH,
  k_BQKH,
  v_BQKH,
  k_cache_LBSKH,
  v_cache_LBSKH,
  layer,
  *,
  backend,
  kind,
  block_size=0,
  segment_ids_BL=None,
  valid_length_B=None,
  query_start=0,
):
  """slice_attention of a slice whose keys are layer `layer` of the stacked cache [layers, B, S,
  K, H] with the slice's fresh k, v [B, Q, K, H] in its place from query_start. pallas, and
  auto on GPU, read the cache in place (flash_attention_slice_cached): the transformer hands
  every layer the whole cache and its index instead of a per-layer slice, and nothing writes
  the fresh K/V into a copy of it. At the 1.7B's sampler shape (batch 64, 320 positions) those
  two copies were ~134 MB of memory traffic per layer per step (docs/benchmarks.md, Sampler,
  K/V caches). The other backends take the copying path (gathered_slice_attention)."""
  mask = dict(kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL)
  if _slice_kernel_serves(backend, kind, q_BQNH.shape[-1]):

    def attend(q, k, v, k_cache, v_cache, layer, seg, valid, start):
      kw = dict(mask, segment_ids_BL=seg, valid_length_B=valid, query_start=start)
      return flash_attention.flash_attention_slice_cached(q, k, v, k_cache, v_cache, layer, **kw)

    heads = (rules.BATCH, None, rules.ATTN_HEADS, None)
    cache = (None, *heads)
    operands = (k_cache_LBSKH, v_cache_LBSKH, jnp.asarray(layer), segment_ids_BL, valid_length_B)
    return rules.per_shard(
      attend,
      (q_BQNH, k_BQKH, v_BQKH, *operands, jnp.asarray(query_start)),
      (heads, heads, heads, cache, cache, (), (rules.BATCH, None), (rules.BATCH,), ()),
      heads,
    )
  kw = dict(mask, backend=backend, valid_length_B=valid_length_B, query_start=query_start)
  return gathered_slice_attention(q_BQNH, k_BQKH, v_BQKH, k_cache_LBSKH, v_cache_LBSKH, layer, **kw)


def gathered_slice_attention(
  q_BQNH, k_BQKH, v_BQKH, k_cache_LBSKH, v_cache_LBSKH, layer, *, backend, query_start=0, **mask
):
  """cached_slice_attention by copies: the layer's cache gathered, the fresh K/V written into
  it, then slice_attention (the path before the in-place kernel, and every non-pallas one)."""
  k, v = (
    jax.lax.dynamic_update_slice_in_dim(
      jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False),
      fresh.astype(cache.dtype),
      query_start,
      axis=1,
    )
    for cache, fresh in ((k_cache_LBSKH, k_BQKH), (v_cache_LBSKH, v_BQKH))
  )
  heads = (rules.BATCH, None, rules.ATTN_HEADS, None)
  k, v = (rules.constrain(t, heads) for t in (k, v))
  return slice_attention(q_BQNH, k, v, backend=backend, query_start=query_start, **mask)


BACKENDS = {
  'xla': xla_attention,
  'cudnn': cudnn_attention,
  'pallas': pallas_attention,
  'auto': auto_attention,
}


class Attention(nnx.Module):
  """Multi-head attention with RMSNorm on q and k over the head dim, applied before RoPE.

  qk_norm=False sends q and k straight to RoPE (Qwen2, Llama; the fused norm + RoPE kernel then
  has nothing to fuse). qkv_bias=True adds biases [N or K, H] to the q, k and v projections in
  their output dtype, after the (possibly FP8) matmul, as transformers' Qwen2Attention; o has none.

  fused (ModelConfig.fused_projections, the inference layout): q, k and v are one weight
  `qkv_proj` [D, N + 2K, H] along the heads (Attention.fuse builds it, and `qkv_proj_bias`, from
  the trained ones), one matmul then split; their adapters, if any, stay their own.
  """

  FUSED = ('qkv_proj', ('q_proj', 'k_proj', 'v_proj'), -2)  # (name, parts, output axis)
  _BIASES = ('q_bias', 'k_bias', 'v_bias')

  def __init__(
    self,
    *,
    d_model,
    num_heads,
    num_kv_heads,
    head_dim,
    norm_eps,
    rope_theta,
    std,
    out_std,
    rngs: nnx.Rngs,
    num_stacked: int = 0,
    matmul_dtype: str = 'compute',
    norm_backend: str = 'xla',
    qk_norm: bool = True,
    qkv_bias: bool = False,
    rope_scaling: str = '',
    rope_dim: int = 0,
    lora_spec: lora.Spec | None = None,
    weight_quant: str = 'none',
    fused: bool = False,
  ):
    kw = dict(num_stacked=num_stacked)
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.fused = fused
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling  # model.rope_scaling (layers.rope_inv_freq)
    self.rope_dim = rope_dim  # dims of each head RoPE rotates (0 = all; model.rope_fraction)
    self.qk_norm = qk_norm
    self.qkv_bias = qkv_bias
    self.matmul_dtype = matmul_dtype  # q/k/v/o only: the attention core stays in the compute dtype
    self.lora_spec = lora_spec
    proj = dict(num_stacked=num_stacked, lora_spec=lora_spec, quant=weight_quant)
    parts = (
      ('q_proj', num_heads, rules.HEADS),
      ('k_proj', num_kv_heads, rules.KV_HEADS),
      ('v_proj', num_kv_heads, rules.KV_HEADS),
    )
    if fused:  # the heads of all three, one weight; each part's adapter beside it
      shape = (d_model, num_heads + 2 * num_kv_heads, head_dim)
      axes = (rules.EMBED, rules.HEADS, rules.HEAD_DIM)
      fused_proj = dict(proj, lora_spec=None)
      layers.add_projection(
        self, 'qkv_proj', rngs, shape, axes, std=std, contract_ndim=1, **fused_proj
      )
      for name, heads, head_axis in parts:
        shape, axes = (d_model, heads, head_dim), (rules.EMBED, head_axis, rules.HEAD_DIM)
        layers.add_adapter_params(self, name, rngs, shape, axes, num_stacked, 1, lora_spec)
    else:
      for name, heads, head_axis in parts:
        layers.add_projection(
          self,
          name,
          rngs,
          (d_model, heads, head_dim),
          (rules.EMBED, head_axis, rules.HEAD_DIM),
          std=std,
          contract_ndim=1,
          **proj,
        )
    layers.add_projection(
      self,
      'o_proj',
      rngs,
      (num_heads, head_dim, d_model),
      (rules.HEADS, rules.HEAD_DIM, rules.EMBED),
      std=out_std,
      contract_ndim=2,
      **proj,
    )
    if qkv_bias and fused:
      self.qkv_proj_bias = layers.stacked_param(
        rngs,
        (num_heads + 2 * num_kv_heads, head_dim),
        (rules.HEADS, rules.HEAD_DIM),
        zeros=True,
        **kw,
      )
    elif qkv_bias:  # zeros, as nn.Linear's bias is reset by transformers' Qwen2 init.
      for name, heads, axis in (
        ('q_bias', num_heads, rules.HEADS),
        ('k_bias', num_kv_heads, rules.KV_HEADS),
        ('v_bias', num_kv_heads, rules.KV_HEADS),
      ):
        setattr(
          self,
          name,
          layers.stacked_param(rngs, (heads, head_dim), (axis, rules.HEAD_DIM), zeros=True, **kw),
        )
    if qk_norm:
      norm = dict(eps=norm_eps, rngs=rngs, backend=norm_backend, **kw)
      self.q_norm = layers.RMSNorm(head_dim, **norm)
      self.k_norm = layers.RMSNorm(head_dim, **norm)

  def __call__(self, x_BLD, positions_BL, **kwargs):
    """The output [B, L, D] (`with_kv` without its K/V)."""
    return self.with_kv(x_BLD, positions_BL, **kwargs)[0]

  def with_kv(
    self,
    x_BLD,
    positions_BL,
    *,
    kind,
    block_size,
    backend,
    segment_ids_BL=None,
    valid_length_B=None,
    kv_cache=None,
    cache_start=0,
    cache_layer=None,
  ):
    """(output [B, L, D], x's own post-RoPE keys and values (k, v), each [B, L, K, H]).

    Without kv_cache x attends to its own keys. With kv_cache (k, v), every layer's K/V
    [layers, B, S, K, H] of a whole sequence of S positions, of which this layer's are at
    cache_layer (may be traced: the layer scan's index), x is its slice from cache_start
    (positions_BL are the slice's): the slice's fresh k and v take the cache's place there and
    its queries attend to all S keys, with the mask those positions have in the whole sequence
    (segment ids and lengths then cover the S keys). A slice shorter than S runs
    cached_slice_attention (pallas and GPU auto: the kernel reading the cache in place).
    """
    q, k, v = self._project_qkv(x_BLD)
    q = checkpoint_name(q, 'query_proj')
    k = checkpoint_name(k, 'key_proj')
    v = checkpoint_name(v, 'value_proj')
    rope = (positions_BL, self.rope_theta, self.rope_scaling, self.rope_dim)
    if self.qk_norm:
      q, k = self.q_norm.with_rope(q, *rope), self.k_norm.with_rope(k, *rope)
    else:
      q, k = layers.rotary_embedding(q, *rope), layers.rotary_embedding(k, *rope)
    q = checkpoint_name(q, 'query_rope')
    k = checkpoint_name(k, 'key_rope')
    heads = (rules.BATCH, rules.LENGTH, rules.ACT_HEADS, None)
    # The kernel sees whole sequences: with context parallelism the heads are split over the
    # context devices instead of the sequence (an all-to-all each way, DeepSpeed-Ulysses), so
    # every mask kind, document mask and backend stays exact.
    kernel = (rules.BATCH, None, rules.ATTN_HEADS, None)
    fresh = (k, v)
    q, k, v = (rules.constrain(t, kernel) for t in (q, k, v))
    mask = dict(kind=kind, block_size=block_size, segment_ids_BL=segment_ids_BL)
    if kv_cache is not None and q.shape[1] != kv_cache[0].shape[2]:
      kw = dict(mask, backend=backend, valid_length_B=valid_length_B, query_start=cache_start)
      out = cached_slice_attention(q, k, v, *kv_cache, cache_layer, **kw)
    else:  # no cache, or a slice of all S positions: its fresh K/V are all the keys.
      out = BACKENDS[backend](q, k, v, valid_length_B=valid_length_B, **mask)
    out = checkpoint_name(rules.constrain(out, heads), 'context')
    out = self._project('o_proj', 'blnh,nhd->bld', out)
    return checkpoint_name(out, 'out_proj'), fresh

  @classmethod
  def fuse(cls, tree: dict) -> dict:
    """The module's trained parameter dict in the fused layout: q / k / v weights (and their
    quantisation scales, layers.fuse_projections) and biases concatenated along the heads."""
    fused, parts, axis = cls.FUSED
    out = layers.fuse_projections(tree, parts, fused, axis)
    if cls._BIASES[0] in tree:
      out['qkv_proj_bias'] = jnp.concatenate([out.pop(name) for name in cls._BIASES], axis=-2)
    return out

  def _project_qkv(self, x_BLD):
    """(q, k, v), biases added: three matmuls, or one over the fused weight."""
    if not self.fused:
      q = self._project('q_proj', 'bld,dnh->blnh', x_BLD)
      k = self._project('k_proj', 'bld,dkh->blkh', x_BLD)
      v = self._project('v_proj', 'bld,dkh->blkh', x_BLD)
      if self.qkv_bias:
        q = q + self.q_bias.value.astype(q.dtype)[None, None]
        k = k + self.k_bias.value.astype(k.dtype)[None, None]
        v = v + self.v_bias.value.astype(v.dtype)[None, None]
      return q, k, v
    fused, names, axis = self.FUSED
    heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
    qkv = layers.project_fused(
      self,
      fused,
      tuple(zip(names, heads)),
      axis,
      'bld,dnh->blnh',
      x_BLD,
      self.matmul_dtype,
      self.lora_spec,
    )
    if self.qkv_bias:  # after each part's adapter, as the three projections add it
      biases = jnp.split(self.qkv_proj_bias.value, [heads[0], heads[0] + heads[1]], axis=-2)
      qkv = [t + b.astype(t.dtype)[None, None] for t, b in zip(qkv, biases)]
    return tuple(qkv)

  def _project(self, name, equation, x):
    w = getattr(self, name).value
    extra = layers.projection_operands(self, name, self.lora_spec)
    return layers.project(equation, x, w, self.matmul_dtype, **extra)
