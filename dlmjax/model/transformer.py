"""The Qwen3-style transformer: embedding, a scanned stack of pre-norm blocks, final norm, head.

All layers live in one stacked Block (leading `layers` axis); `__call__` scans over it with the
configured remat policy, so compile time and HLO size do not grow with depth. An MoE model with
dense layers (model.moe.dense_layers) holds one stacked Block per maximal run of layers of one kind
(ModelConfig.layer_runs: `blocks`, `blocks_1`, ...), each scanned in turn; a model whose layers
are all of one kind has the single `blocks` it always had.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dlmjax.model import attention, layers, lora, moe, moe_stats
from dlmjax.model.presets import ModelConfig
from dlmjax.parallel import pipeline, rules

# Names tagged with checkpoint_name in attention.py / layers.py.
_PROJECTIONS = ('query_proj', 'key_proj', 'value_proj', 'out_proj', 'mlp_gate', 'mlp_up', 'mlp_out')
# Attention kernels: cuDNN's forward (inside jax.nn.dot_product_attention's custom VJP), the
# Triton flash kernel's forward (a pallas_call named flash_attention_fwd) and the Mosaic GPU
# kernel (it shows up as the custom_vmap_call that wraps it). Their outputs, the attention output
# and its softmax statistics, are what their backward needs.
_ATTENTION_KERNELS = (
  'dot_product_attention_fwd_wrapper',
  'dot_product_attention_fwd',
  'custom_vmap_call',
)


def _pallas_kernel(prim, params, prefix: str) -> bool:
  return prim.name == 'pallas_call' and str(params.get('name') or '').startswith(prefix)


def _save_dots_and_attention(prim, *avals, **params):
  """save_dots, plus the attention kernel's outputs: the backward then runs the attention
  backward straight away instead of first re-running the whole attention forward (which under
  save_dots costs a third of attention's time)."""
  return (
    prim.name in _ATTENTION_KERNELS
    or _pallas_kernel(prim, params, 'flash_attention')
    or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)
  )


def _save_norm_kernels(prim, *_, **params):
  """The Pallas norm kernel's outputs (dlmjax/kernels/rms_norm.py): the normalised value, which
  the activation names save anyway, and its float32 inverse rms, one value per row."""
  return _pallas_kernel(prim, params, 'rms_norm')


# The elementwise results between the matmuls, in the compute dtype (attention.py / layers.py),
# and the mid-layer residual stream, which the second norm's backward reads.
_ACTIVATIONS = ('attn_norm', 'query_rope', 'key_rope', 'attn_residual', 'mlp_norm', 'mlp_hidden')

REMAT_POLICIES = {
  'none': None,
  'minimal': jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS, 'context'),
  'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'save_dots_attention': _save_dots_and_attention,
  # Everything the backward reads, each once in the compute dtype: no recomputation but the
  # XLA norms' float32 statistics (the norm kernels' are kept; 'none' keeps the float32
  # intermediates instead).
  'save_activations': jax.checkpoint_policies.save_from_both_policies(
    _save_dots_and_attention,
    jax.checkpoint_policies.save_from_both_policies(
      _save_norm_kernels, jax.checkpoint_policies.save_only_these_names(*_ACTIVATIONS)
    ),
  ),
  'full': jax.checkpoint_policies.nothing_saveable,
}


class Block(nnx.Module):
  """x + Attn(RMS(x)), then x + MLP(RMS(x)); params stacked over `num_stacked` layers."""

  def __init__(
    self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_stacked: int = 0, moe_mlp: bool | None = None
  ):
    """moe_mlp: the MLP is the MoE (default: whenever the model has experts)."""
    if moe_mlp is None:
      moe_mlp = bool(cfg.num_experts)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # Megatron output_layer_init_method.
    kw = dict(rngs=rngs, num_stacked=num_stacked)
    norm = dict(eps=cfg.norm_eps, backend=cfg.norm_backend, **kw)
    self.input_norm = layers.RMSNorm(cfg.d_model, **norm)
    self.attn = attention.Attention(
      d_model=cfg.d_model,
      num_heads=cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta,
      rope_scaling=cfg.rope_scaling,
      rope_dim=cfg.rope_dim,
      std=cfg.init_std,
      out_std=out_std,
      matmul_dtype=cfg.matmul_dtype,
      norm_backend=cfg.norm_backend,
      qk_norm=cfg.qk_norm,
      qkv_bias=cfg.qkv_bias,
      lora_spec=cfg.lora_spec,
      weight_quant=cfg.weight_quant,
      fused=cfg.fused_projections,
      **kw,
    )
    self.post_attn_norm = layers.RMSNorm(cfg.d_model, **norm)
    if moe_mlp:
      self.mlp = moe.MoE(
        cfg.d_model,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.expert_dim,
        router=cfg.router,
        router_groups=cfg.router_groups,
        router_group_topk=cfg.router_group_topk,
        routed_scale=cfg.routed_scale,
        shared_ffn_dim=cfg.shared_experts * cfg.expert_dim,
        backend=cfg.moe_backend,
        exchange=cfg.moe_exchange,
        fused=cfg.fused_projections,
        block_experts=cfg.block_experts,
        block_size=cfg.block_size,
        std=cfg.init_std,
        out_std=out_std,
        **kw,
      )
    else:
      self.mlp = layers.MLP(
        cfg.d_model,
        cfg.ffn_dim,
        std=cfg.init_std,
        out_std=out_std,
        matmul_dtype=cfg.matmul_dtype,
        lora_spec=cfg.lora_spec,
        weight_quant=cfg.weight_quant,
        fused=cfg.fused_projections,
        **kw,
      )

  def __call__(self, x_BLD, positions_BL, expert_layer=None, **attention_kwargs):
    """(x out, the attention's (k, v), the MoE router's statistics or None); attention_kwargs go
    to Attention (kv_cache included). expert_layer: the MoE's routed experts are whole stacks
    and this block is that layer of them (_run_layers, ModelConfig.experts_in_place)."""
    x_BLD, normed_BLD = self.input_norm.with_residual(x_BLD)
    attn_BLD, kv = self.attn.with_kv(
      checkpoint_name(normed_BLD, 'attn_norm'), positions_BL, **attention_kwargs
    )
    x_BLD = x_BLD + attn_BLD
    x_BLD, normed_BLD = self.post_attn_norm.with_residual(checkpoint_name(x_BLD, 'attn_residual'))
    normed_BLD = checkpoint_name(normed_BLD, 'mlp_norm')
    stats = None
    if isinstance(self.mlp, moe.MoE):
      mlp_out, stats = self.mlp(normed_BLD, layer=expert_layer)
    else:
      mlp_out = self.mlp(normed_BLD)
    x_BLD = x_BLD + mlp_out
    return rules.constrain(x_BLD, (rules.BATCH, rules.LENGTH, rules.ACT_EMBED)), kv, stats


def _run_layers(
  cfg,
  graphdef,
  stacked,
  x_BLD,
  side,
  kv_cache=None,
  cache_start=0,
  want_kv=False,
  kind=None,
  first=0,
):
  """The stacked blocks (leading axis: layers) applied in order, scanned or unrolled, with remat.

  Returns (x, every layer's fresh (k, v) of x stacked [layers, B, L, K, H], or None unless
  want_kv, an MoE's router sums (moe_stats.layer_sums) stacked over layers or None); kv_cache,
  [layers, B, S, K, H], holds the K/V each layer's slice attends to. kind overrides
  cfg.attention_mask (two_stream: Transformer.hidden's clean_BL). first: the model's index of the
  stack's first layer (a run of layers, ModelConfig.layer_runs), so LoRA dropout draws each
  layer's own key and each layer reads its own layer of the cache.

  The cache is no scan operand: every layer gets the whole stacked cache (a constant the scan
  closes over, never copied) and its own index, and its attention reads its layer in place
  (attention.cached_slice_attention). Scanned, the cache would be cut into a [B, S, K, H] copy
  per layer per step (docs/benchmarks.md, Sampler, K/V caches).

  With cfg.experts_in_place (the inference layout) an MoE's routed experts are handled the same
  way: neither scanned nor unstacked, every layer gets the whole [layers, E, ...] stacks and its
  index, and the grouped matmul reads its layer in place (kernels/grouped_matmul.py). Cut per
  layer, the Pallas kernel's operand was a copy of the layer's every expert, each step: 40 of a
  46 ms LLaDA2.0-mini decode step on an H100 (docs/benchmarks.md, LLaDA2.0-mini). Training
  keeps the cut: the gradient of a whole stack per layer would hold the stack once per layer.
  """
  attention_kwargs = dict(
    kind=kind or cfg.attention_mask,
    block_size=cfg.block_size,
    backend=cfg.attention_backend,
    segment_ids_BL=side.get('segment_ids_BL'),
    valid_length_B=side.get('valid_length_B'),
    kv_cache=kv_cache,
    cache_start=cache_start,
  )

  dropout = lora.dropout_active()  # a LoRA train step's adapter dropout: per-layer keys
  stacked, experts = _split_experts(cfg, stacked)
  experts = _compute_weights(cfg, experts)  # cast once, outside the loop (a no-op when computed)

  def layer(x, inputs):
    layer_params, index = inputs
    cache_layer = None if kv_cache is None else index
    expert_layer = None
    if experts:  # the whole stacks, and this layer's index among them
      layer_params = dict(layer_params, mlp=dict(layer_params['mlp'], **experts))
      expert_layer = index - first
    with lora.dropout_layer(index):
      block = nnx.merge(graphdef, layer_params)
      x, kv, stats = block(
        x,
        side['positions_BL'],
        expert_layer=expert_layer,
        cache_layer=cache_layer,
        **attention_kwargs,
      )
    return x, (kv if want_kv else None, stats)

  if cfg.remat != 'none':
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    needs_index = dropout or kv_cache is not None or experts
    indices = first + jnp.arange(num_layers) if needs_index else None
    x_BLD, (kv, stats) = jax.lax.scan(layer, x_BLD, (_compute_weights(cfg, stacked), indices))
    return x_BLD, kv, stats
  kvs, stats = [], []
  for i, layer_params in enumerate(_unstack(stacked)):
    x_BLD, (kv, layer_sums) = layer(x_BLD, (_compute_weights(cfg, layer_params), first + i))
    kvs.append(kv)
    stats.append(layer_sums)
  stacked_stats = None if stats[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *stats)
  return x_BLD, (tuple(jnp.stack(c) for c in zip(*kvs)) if want_kv else None), stacked_stats


_ROUTED_EXPERTS = ('gate_proj', 'up_proj', 'down_proj')  # moe.MoE's stacked expert weights


def _split_experts(cfg, stacked):
  """(stacked without the routed experts, {name: whole stack}) under cfg.experts_in_place and an
  MoE stack (its router tells it from a dense MLP of the same weight names); else (stacked, {})."""
  mlp = stacked.get('mlp', {})
  if not cfg.experts_in_place or 'router_kernel' not in mlp:
    return stacked, {}
  rest = {k: v for k, v in mlp.items() if k not in _ROUTED_EXPERTS}
  return dict(stacked, mlp=rest), {name: mlp[name] for name in _ROUTED_EXPERTS}


def _unstack(stacked):
  """Per-layer parameter trees, cut from the stacked ones with one split per leaf.

  A split's transpose is one concatenate, so the stacked gradient is assembled in one pass.
  Indexing each layer (p[i]) transposes to a zero-padded full-size array per layer, which XLA
  sums in fusions that read every layer's gradient for each element: 15 ms of a 358 ms 1.7B
  step on an H200 (docs/benchmarks.md, 1.7B pre-training step).
  """
  leaves, treedef = jax.tree.flatten(stacked)
  num = leaves[0].shape[0]
  split = [[s.squeeze(0) for s in jax.lax.split(p, [1] * num, axis=0)] for p in leaves]
  return [treedef.unflatten(layer) for layer in zip(*split)]


def _compute_weights(cfg, params):
  """The layer's float32 parameters cast to the compute dtype, outside the remat region.

  Every use in a layer casts them to that dtype anyway (projections, norm gains), so the values
  are the same; cast here, the backward reuses the forward's copy instead of re-casting each
  weight from float32. FP8 projections quantise from float32 and keep it. An int8 base weight
  stays int8 (its projection dequantises it, model/quantize.py): a cast here would hold a
  compute-dtype copy of every layer.
  """
  if cfg.matmul_dtype != 'compute':
    return params

  def cast(p):
    return p.astype(cfg.compute_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p

  return jax.tree.map(cast, params)


def fusable(cfg) -> bool:
  """Whether the inference layout may fuse cfg's projections: bf16 / float32 matmuls (an FP8
  matmul scales each weight as a whole, so a fused one would round its parts differently) and
  a tree not fused already."""
  return cfg.matmul_dtype == 'compute' and not cfg.fused_projections


def inference_config(cfg, *, fuse: bool = True, experts_in_place: bool = True):
  """The ModelConfig whose module holds computed_params(cfg, params, fuse=fuse), its routed
  experts read in place by the layer loop unless experts_in_place=False (a benchmark's
  baseline: each layer's experts cut from their stacks). In place needs the experts in the
  compute dtype, as computed_params leaves them for matmuls in the compute dtype (an FP8 model's
  stacks would be cast whole in every layer)."""
  if fuse and fusable(cfg):
    cfg = dataclasses.replace(cfg, fused_projections=True)
  if experts_in_place and cfg.num_experts and cfg.matmul_dtype == 'compute':
    cfg = dataclasses.replace(cfg, experts_in_place=True)
  return cfg


def computed_params(cfg, params: dict, *, fuse: bool = True) -> dict:
  """params as a forward computes with them: each layer's weights through _compute_weights, the
  embedding and the output head in the compute dtype; the final norm's gain as stored. With
  fuse (and a fusable cfg), also each layer's q / k / v weights concatenated into one, and the
  dense MLP's (and an MoE's shared experts') gate / up into one (Attention.fuse, MLP.fuse): the
  tree of inference_config(cfg), whose forward runs one matmul for each group instead of three
  and two. An MoE's routed experts keep their own layout.

  Every forward casts these values at use (jnp.take(...).astype, head_weight_DV().astype), so a
  program that runs many forwards over the same weights (the sampler's decode) casts once here
  instead of once a step: on an H200 the per-step cast of the 8B's float32 weights took 10 ms of
  a 23 ms decode step (docs/benchmarks.md, Sampler, where a decode step's time goes). The final
  norm's gain (D values, cast at use as well) stays as stored. Cast alone, the logits are
  identical; fused, they are those of another matmul grouping (float32 on the CPU: within 1e-6;
  docs/benchmarks.md, Sampler, Fused projections). Concatenated here, before the decode loop,
  the fused weights are written once per generate, not once a step (XLA's dot merger did that
  per step, model/programs.py).
  """
  if cfg.matmul_dtype != 'compute':
    return params
  fuse = fuse and fusable(cfg)
  out = dict(params)
  for key, moe_mlp, *_ in cfg.layer_runs():
    out[key] = _compute_weights(cfg, params[key])
    if fuse:
      out[key] = dict(out[key], attn=attention.Attention.fuse(out[key]['attn']))
      mlp = out[key]['mlp']
      if not moe_mlp:
        out[key]['mlp'] = layers.MLP.fuse(mlp)
      elif 'shared' in mlp:  # the routed experts' grouped matmuls keep gate and up apart
        out[key]['mlp'] = dict(mlp, shared=layers.MLP.fuse(mlp['shared']))
  for key in ('embed_tokens', 'lm_head'):
    dtype = getattr(params.get(key), 'dtype', None)  # an adapted head is a dict: left alone
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
      out[key] = params[key].astype(cfg.compute_dtype)
  return out


def shift_predictions(hidden_BLD, segment_ids_BL=None):
  """Dream's alignment (model.shift_logits): the prediction for token i is read from the hidden
  state at i-1, as its generate shifts the logits right by one (cat([l[:, :1], l[:, :-1]])); the
  first position of a row keeps its own, and so does the first of each packed document (its
  predecessor belongs to another document). Done on the hidden states, so every consumer of
  `hidden` (losses, the fused head + CE, likelihood, RL, the sampler's block slice) sees
  token-aligned predictions."""
  previous_BLD = jnp.concatenate([hidden_BLD[:, :1], hidden_BLD[:, :-1]], axis=1)
  if segment_ids_BL is not None:
    previous_segment_BL = jnp.concatenate([segment_ids_BL[:, :1], segment_ids_BL[:, :-1]], axis=1)
    starts_BL = segment_ids_BL != previous_segment_BL
    previous_BLD = jnp.where(starts_BL[..., None], hidden_BLD, previous_BLD)
  return rules.constrain(previous_BLD, (rules.BATCH, rules.LENGTH, rules.ACT_EMBED))


class Transformer(nnx.Module):
  """Bidirectional (or causal / block-causal) transformer returning float32 logits."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = layers.stacked_param(
      rngs, (cfg.vocab_size, cfg.d_model), (rules.VOCAB, rules.EMBED), std=cfg.init_std
    )
    for key, moe_mlp, start, end in cfg.layer_runs():  # `blocks` first (ModelConfig.layer_runs)
      setattr(self, key, Block(cfg, rngs=rngs, num_stacked=end - start, moe_mlp=moe_mlp))
    self.final_norm = layers.RMSNorm(
      cfg.d_model, eps=cfg.norm_eps, rngs=rngs, backend=cfg.norm_backend
    )
    if cfg.score_head:  # a reward model: transformers' *ForSequenceClassification `score`
      self.score = layers.stacked_param(
        rngs, (cfg.d_model, 1), (rules.EMBED, None), std=cfg.init_std
      )
    elif not cfg.tie_embeddings:
      self.lm_head = layers.stacked_param(
        rngs, (cfg.d_model, cfg.vocab_size), (rules.EMBED, rules.VOCAB), std=cfg.init_std
      )

  def hidden(
    self, tokens_BL, *, segment_ids_BL=None, valid_length_B=None, positions_BL=None, clean_BL=None
  ):
    """Final-norm hidden states [B, L, D] in the compute dtype (the input of the output head);
    with model.shift_logits, position i holds the state predicting token i (shift_predictions).

    clean_BL (a block_causal model): BD3LM's training forward. tokens_BL is the noisy x_t and
    clean_BL the clean x_0; the layers run once over [x_t || x_0] (2L) with the two-stream mask
    (kernels/flash_masks.py two_stream_visible), the clean copy at the same RoPE positions,
    segment ids and lengths applying to both streams; only x_t's L rows come back (the head never
    sees the clean stream). docs/block_diffusion.md.
    """
    if clean_BL is None:
      return self._hidden(tokens_BL, segment_ids_BL, valid_length_B, positions_BL)[0]
    if self.cfg.attention_mask != 'block_causal' or self.cfg.shift_logits:
      raise ValueError(
        'the two-stream (block diffusion) forward needs a block_causal model without '
        'shift_logits; set --config.model.attention_mask=block_causal.'
      )
    length = tokens_BL.shape[1]
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(length), tokens_BL.shape)

    def both(x):
      return None if x is None else jnp.concatenate([x, x], axis=1)

    hidden_BLD, _ = self._hidden(
      jnp.concatenate([tokens_BL, clean_BL], axis=1),
      both(segment_ids_BL),
      valid_length_B,
      both(positions_BL),
      kind='two_stream',
      rows=length,
    )
    return hidden_BLD

  def hidden_kv(
    self,
    tokens_BL,
    *,
    positions_BL,
    segment_ids_BL=None,
    valid_length_B=None,
    kv_cache=None,
    cache_start=0,
  ):
    """(hidden [B, L, D], every layer's post-RoPE (k, v) of tokens_BL, each [layers, B, L, K,
    H]): the cached decoding of the sampler (diffusion/sampler.py; Fast-dLLM's caches).

    Without kv_cache, a whole sequence, whose K/V serve later slices. With it (K/V of a sequence
    of S positions, [layers, B, S, K, H]), tokens_BL are the positions [cache_start, cache_start +
    L) of that sequence, positions_BL their RoPE positions, segment_ids_BL and valid_length_B
    cover all S: the slice attends to the cache with its own fresh K/V in their place, and only
    those fresh K/V come back (write them in to keep them). The same layers as `hidden`, so a
    slice attending to K/V computed from the same sequence gives hidden's rows (up to rounding).
    With model.shift_logits the slice's first row has no predecessor in it and keeps its own
    state: a caller that needs it runs the slice from one position earlier (the sampler does).
    """
    if self.cfg.pipeline_stages > 1:
      raise ValueError(
        'cached decoding runs the layers in one program; sample with model.pipeline_stages=1.'
      )
    return self._hidden(
      tokens_BL, segment_ids_BL, valid_length_B, positions_BL, kv_cache, cache_start, True
    )

  def _hidden(
    self,
    tokens_BL,
    segment_ids_BL,
    valid_length_B,
    positions_BL,
    kv_cache=None,
    cache_start=0,
    want_kv=False,
    kind=None,
    rows=None,
  ):
    """rows: keep the first `rows` positions before the final norm (the two-stream forward)."""
    cfg = self.cfg
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    x_BLD = jnp.take(self.embed_tokens.value, tokens_BL, axis=0).astype(cfg.compute_dtype)
    x_BLD = rules.constrain(x_BLD, (rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
    # Per-row inputs every layer needs; the pipeline hands each stage its micro-batch's rows.
    side = dict(
      positions_BL=positions_BL, segment_ids_BL=segment_ids_BL, valid_length_B=valid_length_B
    )
    side = {k: v for k, v in side.items() if v is not None}
    runs = cfg.layer_runs()
    kv = None
    if cfg.pipeline_stages > 1 and not want_kv:
      if len(runs) > 1:
        raise ValueError(
          'pipeline stages split one stack of identical layers; a model with dense and MoE '
          'layers (model.moe.dense_layers) runs with model.pipeline_stages=1.'
        )
      graphdef, stacked = nnx.split(self.blocks)
      params = nnx.to_pure_dict(stacked)

      def run_layers(layer_params, x_BLD, side):  # (x, an MoE's router sums or None)
        x_BLD, _, sums = _run_layers(cfg, graphdef, layer_params, x_BLD, side, kind=kind)
        return x_BLD, sums

      axes = nnx.to_pure_dict(
        jax.tree.map(
          lambda v: v.get_metadata()['axes'], stacked, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
      )
      x_BLD, sums = pipeline.run(
        run_layers,
        params,
        axes,
        x_BLD,
        side,
        stages=cfg.pipeline_stages,
        repeats=cfg.pipeline_repeats,
        microbatches=cfg.pipeline_microbatches,
        aux=True,
      )
      if sums is not None:  # [M, L, ...]: summed over the micro-batches, then formed (as below)
        moe_stats.record(moe_stats.layer_stats(jax.tree.map(lambda a: jnp.sum(a, axis=0), sums)))
    else:
      kvs, stats = [], []
      for key, _, start, _ in runs:  # each run of one kind of layer, scanned, in order
        graphdef, stacked = nnx.split(getattr(self, key))
        x_BLD, run_kv, run_stats = _run_layers(
          cfg,
          graphdef,
          nnx.to_pure_dict(stacked),
          x_BLD,
          side,
          kv_cache,  # the whole stack: each layer reads its own (first + its index) in place
          cache_start,
          want_kv,
          kind=kind,
          first=start,
        )
        kvs.append(run_kv)
        if run_stats is not None:
          stats.append(run_stats)
      if want_kv:  # every layer's, in order: [layers, B, L, K, H]
        kv = kvs[0] if len(kvs) == 1 else tuple(jnp.concatenate(c) for c in zip(*kvs))
      elif stats:  # the MoE layers' router sums only, stacked in order
        stats = stats[0] if len(stats) == 1 else jax.tree.map(lambda *s: jnp.concatenate(s), *stats)
        # the train step's router losses and metrics (moe_stats.collect)
        moe_stats.record(moe_stats.layer_stats(stats))
    if rows is not None:
      x_BLD = rules.constrain(x_BLD[:, :rows], (rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
    hidden_BLD = self.final_norm(x_BLD)
    if cfg.shift_logits:
      if kv_cache is not None and segment_ids_BL is not None:  # they cover the whole sequence.
        segment_ids_BL = jax.lax.dynamic_slice_in_dim(
          segment_ids_BL, cache_start, tokens_BL.shape[1], axis=1
        )
      hidden_BLD = shift_predictions(hidden_BLD, segment_ids_BL)
    return hidden_BLD, kv

  def head_weight_DV(self):
    """The output projection [D, V] (the embedding, transposed, when tied)."""
    if self.cfg.score_head:
      raise ValueError(
        'a reward model (stage reward) has a score head, not token logits: score rows with '
        'Transformer.scores (dlmjax/rl/reward_model.py; RL reads it through rl.reward_model).'
      )
    return self.embed_tokens.value.T if self.cfg.tie_embeddings else self.lm_head.value

  def logits(self, hidden_BLD, dtype=jnp.float32):
    """The output head's logits in `dtype`: float32 where a softmax or a loss reads them, the
    compute dtype where a caller only ranks or returns them (an 8B's [16, 512, 126464] logits are
    4.1 GB in float32)."""
    w_DV = self.head_weight_DV().astype(hidden_BLD.dtype)
    logits_BLV = jnp.einsum('bld,dv->blv', hidden_BLD, w_DV, preferred_element_type=dtype)
    return rules.constrain(logits_BLV, (rules.BATCH, rules.LENGTH, rules.ACT_VOCAB))

  def scores(self, tokens_BL, pad_id: int, **kwargs):
    """float32 [B]: the score head on the final hidden state at each row's last token that is
    not pad_id, transformers' *ForSequenceClassification pooling (the rightmost position whose
    id differs from config.pad_token_id; position 0 when there is none)."""
    hidden_BLD = self.hidden(tokens_BL, **kwargs)
    positions_BL = jnp.arange(tokens_BL.shape[1], dtype=jnp.int32)[None, :]
    last_B = jnp.argmax(positions_BL * (tokens_BL != pad_id), axis=-1)
    last_BD = jnp.take_along_axis(hidden_BLD, last_B[:, None, None], axis=1)[:, 0]
    w_D1 = self.score.value.astype(last_BD.dtype)
    return jnp.einsum('bd,do->bo', last_BD, w_D1, preferred_element_type=jnp.float32)[:, 0]

  def __call__(self, tokens_BL, *, logits_dtype=jnp.float32, **kwargs):
    return self.logits(self.hidden(tokens_BL, **kwargs), logits_dtype)
