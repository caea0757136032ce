"""The Qwen3-style transformer: embedding, a scanned stack of pre-norm blocks, final norm, head.

All layers live in one stacked Block (leading `layers` axis); `__call__` scans over it with the
configured remat policy, so compile time and HLO size do not grow with depth.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dlmjax.model import attention, layers
from dlmjax.model.presets import ModelConfig
from dlmjax.parallel import pipeline, rules

# Names tagged with checkpoint_name in attention.py / layers.py.
_PROJECTIONS = ('query_proj', 'key_proj', 'value_proj', 'out_proj', 'mlp_gate', 'mlp_up',
                'mlp_out')
REMAT_POLICIES = {
    'none': None,
    'minimal': jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS, 'context'),
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'full': jax.checkpoint_policies.nothing_saveable,
}


class Block(nnx.Module):
  """x + Attn(RMS(x)), then x + MLP(RMS(x)); params stacked over `num_stacked` layers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_stacked: int = 0):
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # Megatron output_layer_init_method.
    kw = dict(rngs=rngs, num_stacked=num_stacked)
    self.input_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
    self.attn = attention.Attention(
        d_model=cfg.d_model, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        std=cfg.init_std, out_std=out_std, matmul_dtype=cfg.matmul_dtype, **kw)
    self.post_attn_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
    self.mlp = layers.MLP(cfg.d_model, cfg.ffn_dim, std=cfg.init_std, out_std=out_std,
                          matmul_dtype=cfg.matmul_dtype, **kw)

  def __call__(self, x_BLD, positions_BL, **attention_kwargs):
    x_BLD = x_BLD + self.attn(self.input_norm(x_BLD), positions_BL, **attention_kwargs)
    x_BLD = x_BLD + self.mlp(self.post_attn_norm(x_BLD))
    return rules.constrain(x_BLD, (rules.BATCH, rules.LENGTH, rules.ACT_EMBED))


def _run_layers(cfg, graphdef, stacked, x_BLD, side):
  """The stacked blocks (leading axis: layers) applied in order, scanned or unrolled, with remat."""
  attention_kwargs = dict(kind=cfg.attention_mask, block_size=cfg.block_size,
                          backend=cfg.attention_backend, segment_ids_BL=side.get('segment_ids_BL'),
                          valid_length_B=side.get('valid_length_B'))

  def layer(x, layer_params):
    return nnx.merge(graphdef, layer_params)(x, side['positions_BL'], **attention_kwargs), None

  if cfg.remat != 'none':
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat],
                           prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    x_BLD, _ = jax.lax.scan(layer, x_BLD, stacked)
  else:
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
      x_BLD, _ = layer(x_BLD, jax.tree.map(lambda p, i=i: p[i], stacked))
  return x_BLD


class Transformer(nnx.Module):
  """Bidirectional (or causal / block-causal) transformer returning float32 logits."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = layers.stacked_param(rngs, (cfg.vocab_size, cfg.d_model),
                                             (rules.VOCAB, rules.EMBED), std=cfg.init_std)
    self.blocks = Block(cfg, rngs=rngs, num_stacked=cfg.num_layers)
    self.final_norm = layers.RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = layers.stacked_param(rngs, (cfg.d_model, cfg.vocab_size),
                                          (rules.EMBED, rules.VOCAB), std=cfg.init_std)

  def hidden(self, tokens_BL, *, segment_ids_BL=None, valid_length_B=None, positions_BL=None):
    """Final-norm hidden states [B, L, D] in the compute dtype (the input of the output head)."""
    cfg = self.cfg
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    x_BLD = jnp.take(self.embed_tokens.value, tokens_BL, axis=0).astype(cfg.compute_dtype)
    x_BLD = rules.constrain(x_BLD, (rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
    # Per-row inputs every layer needs; the pipeline hands each stage its micro-batch's rows.
    side = dict(positions_BL=positions_BL, segment_ids_BL=segment_ids_BL,
                valid_length_B=valid_length_B)
    side = {k: v for k, v in side.items() if v is not None}
    graphdef, stacked = nnx.split(self.blocks)
    params = nnx.to_pure_dict(stacked)

    def run_layers(layer_params, x_BLD, side):
      return _run_layers(cfg, graphdef, layer_params, x_BLD, side)

    if cfg.pipeline_stages > 1:
      axes = nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()['axes'], stacked,
                                           is_leaf=lambda v: isinstance(v, nnx.Variable)))
      x_BLD = pipeline.run(run_layers, params, axes, x_BLD, side, stages=cfg.pipeline_stages,
                           repeats=cfg.pipeline_repeats, microbatches=cfg.pipeline_microbatches)
    else:
      x_BLD = run_layers(params, x_BLD, side)
    return self.final_norm(x_BLD)

  def head_weight_DV(self):
    """The output projection [D, V] (the embedding, transposed, when tied)."""
    return self.embed_tokens.value.T if self.cfg.tie_embeddings else self.lm_head.value

  def logits(self, hidden_BLD):
    w_DV = self.head_weight_DV().astype(hidden_BLD.dtype)
    logits_BLV = jnp.einsum('bld,dv->blv', hidden_BLD, w_DV, preferred_element_type=jnp.float32)
    return rules.constrain(logits_BLV, (rules.BATCH, rules.LENGTH, rules.ACT_VOCAB))

  def __call__(self, tokens_BL, **kwargs):
    return self.logits(self.hidden(tokens_BL, **kwargs))
