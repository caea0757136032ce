"""The frozen ModelConfig that layers are built from (the preset table, PRESETS and apply_preset,
lives in dlmjax/config/presets.py, jax-free for config files; re-exported here).

The ConfigDict stops here: layers receive a ModelConfig (or their own dims), never the whole config.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.config.presets import PRESETS, apply_preset
from dlmjax.model import lora

__all__ = ['PRESETS', 'ModelConfig', 'apply_preset', 'run_key']


def run_key(r: int) -> str:
  """The params key of the r-th run of layers (ModelConfig.layer_runs)."""
  return 'blocks' if r == 0 else f'blocks_{r}'


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  vocab_size: int  # padded: the number of embedding rows and logits.
  seq_len: int
  # The tokenizer's vocabulary (model.vocab_size); rows from here to vocab_size are padding that
  # every loss leaves out of its softmax (diffusion/loss.py column_bias). 0: no padding.
  token_vocab_size: int = 0
  rope_theta: float = 10000.0
  rope_fraction: float = 1.0  # model.rope_fraction: the share of each head's dims RoPE rotates
  rope_scaling: str = ''  # model.rope_scaling: '' or 'TYPE:field=value,...' (layers.rope_inv_freq)
  norm_eps: float = 1e-6
  qk_norm: bool = True  # RMSNorm on q and k per head before RoPE (Qwen3); off for Qwen2 / Llama.
  qkv_bias: bool = False  # biases on q, k, v (Qwen2), added in the projection's output dtype.
  # Dream: token i is predicted from position i-1 (position 0 from itself); transformer.py.
  shift_logits: bool = False
  init_std: float = 0.02
  tie_embeddings: bool = False
  # A reward model (the reward stage, StageTraits.score_head): a linear head `score` [D, 1] on
  # the final hidden state in place of the output head, as transformers' *ForSequenceClassification.
  score_head: bool = False
  attention_mask: str = 'bidirectional'
  block_size: int = 32
  attention_backend: str = 'xla'
  norm_backend: str = 'xla'  # xla | pallas | auto (layers.RMSNorm)
  dtype: str = 'float32'
  matmul_dtype: str = 'compute'  # compute | fp8 (the projections only; layers.project)
  remat: str = 'none'
  scan_layers: bool = True
  # Pipeline schedule of the layer stack (dlmjax/parallel/pipeline.py); 1 stage = plain scan.
  pipeline_stages: int = 1
  pipeline_repeats: int = 1
  pipeline_microbatches: int = 1
  # LoRA adapters (model/lora.py; train.lora.*, set by the train setup): rank 0 = none.
  lora_rank: int = 0
  lora_alpha: float = 0.0
  lora_targets: tuple[str, ...] = ()
  weight_quant: str = 'none'  # none | int8: the projections' storage (model/quantize.py)
  # Mixture of experts (model/moe.py): 0 experts = the dense MLP of ffn_dim.
  num_experts: int = 0
  experts_per_token: int = 2
  moe_ffn_dim: int = 0  # each expert's width (0 = ffn_dim)
  shared_experts: int = 0  # a dense SwiGLU of shared_experts x expert width beside the experts
  router: str = 'softmax_topk'
  # Group-limited routing (model/moe.py): experts in router_groups groups, a token's experts
  # chosen among its router_group_topk best groups; routed_scale multiplies the routed weights.
  router_groups: int = 1
  router_group_topk: int = 1
  routed_scale: float = 1.0
  block_experts: int = 0  # LLaDA2.2's block routing: a block's pool of experts (0 = off)
  moe_backend: str = 'auto'  # the experts' grouped matmul (kernels/grouped_matmul.py BACKENDS)
  moe_exchange: str = 'gather'  # how tokens reach experts split over mesh.expert (moe.EXCHANGES)
  # Layers of an MoE model whose MLP is the dense one of ffn_dim (model.moe.dense_layers).
  dense_layers: tuple[int, ...] = ()
  # The inference layout (no config key; transformer.inference_config sets it): q / k / v and
  # the dense MLP's gate / up each one concatenated weight, as transformer.computed_params
  # builds them from the trained tree. Training, checkpoints and converters never see it.
  fused_projections: bool = False
  # The inference layout too: every layer's routed experts read in place from their stacks
  # (transformer._run_layers), not cut per layer by the layer loop. Forward only.
  experts_in_place: bool = False

  @property
  def lora_spec(self):
    if not self.lora_rank:
      return None
    return lora.Spec(self.lora_rank, self.lora_alpha, self.lora_targets)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @classmethod
  def from_config(cls, config, *, pipeline: bool = False) -> 'ModelConfig':
    """The model of `config`; pipeline=True adds the mesh's pipeline schedule (the train step on
    that mesh), off for everything that just evaluates the function (inference, export)."""
    m = config.model
    schedule = {}
    if pipeline and config.mesh.pipeline > 1:
      schedule = dict(
        pipeline_stages=config.mesh.pipeline,
        pipeline_repeats=config.mesh.pipeline_repeats,
        pipeline_microbatches=config_lib.pipeline_microbatches(config),
      )
    return cls(
      num_layers=m.num_layers,
      d_model=m.d_model,
      num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads,
      head_dim=m.head_dim,
      ffn_dim=m.ffn_dim,
      vocab_size=config_lib.padded_vocab_size(config),
      token_vocab_size=config.model.vocab_size,
      seq_len=m.seq_len,
      rope_theta=m.rope_theta,
      rope_scaling=m.rope_scaling,
      rope_fraction=m.rope_fraction,
      norm_eps=m.norm_eps,
      qk_norm=m.qk_norm,
      qkv_bias=m.qkv_bias,
      shift_logits=m.shift_logits,
      init_std=m.init_std,
      tie_embeddings=m.tie_embeddings,
      score_head=config_lib.stage_traits(config).score_head,
      attention_mask=m.attention_mask,
      block_size=m.block_size,
      attention_backend=m.attention_backend,
      norm_backend=m.norm_backend,
      dtype=m.dtype,
      matmul_dtype=m.matmul_dtype,
      remat=m.remat,
      scan_layers=m.scan_layers,
      num_experts=m.moe.num_experts,
      experts_per_token=m.moe.experts_per_token,
      moe_ffn_dim=m.moe.ffn_dim,
      shared_experts=m.moe.shared_experts,
      router=m.moe.router,
      router_groups=m.moe.router_groups,
      router_group_topk=m.moe.router_group_topk,
      routed_scale=m.moe.routed_scale,
      block_experts=m.moe.block_experts,
      moe_backend=m.moe.backend,
      moe_exchange=m.moe.exchange,
      dense_layers=config_lib.dense_layers(m),
      **schedule,
    )

  @property
  def rope_dim(self) -> int:
    """Dims of each head RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
    return int(self.head_dim * self.rope_fraction)

  @property
  def expert_dim(self) -> int:
    return self.moe_ffn_dim or self.ffn_dim

  def is_moe_layer(self, i: int) -> bool:
    return bool(self.num_experts) and i not in self.dense_layers

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))

  def layer_runs(self) -> tuple[tuple[str, bool, int, int], ...]:
    """(params key, MoE?, first layer, end) of each maximal run of layers of one kind, in order.

    Each run is one stacked Block (transformer.py); the first is `blocks`, so a model whose
    layers are all of one kind has the tree it always had; later ones `blocks_1`, `blocks_2`.
    """
    runs, start = [], 0
    for i in range(1, self.num_layers + 1):
      if i == self.num_layers or self.is_moe_layer(i) != self.is_moe_layer(start):
        runs.append((run_key(len(runs)), self.is_moe_layer(start), start, i))
        start = i
    return tuple(runs)

  def layer_location(self, i: int) -> tuple[str, int]:
    """(params key of layer i's run, its index in that run's stack)."""
    for key, _, start, end in self.layer_runs():
      if start <= i < end:
        return key, i - start
    raise IndexError(f'layer {i} of a {self.num_layers}-layer model')

  def num_params(self, *, active: bool = False) -> int:
    """Exact parameter count, without building the model; active=True counts the parameters
    one token passes through (an MoE's experts_per_token experts, not all of them). Dense
    layers of an MoE model (dense_layers) count the dense MLP of ffn_dim."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * h
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    dense_mlp = 3 * d * self.ffn_dim
    moe_mlp = 0
    if self.num_experts:
      experts = self.experts_per_token if active else self.num_experts
      moe_mlp = 3 * d * self.expert_dim * (experts + self.shared_experts) + d * self.num_experts
      if self.router == 'sigmoid_bias':
        moe_mlp += self.num_experts
    moe = self.num_moe_layers
    layers = self.num_layers * (attn + 2 * d) + moe * moe_mlp + (self.num_layers - moe) * dense_mlp
    embed = self.vocab_size * d
    if self.score_head:  # the score head [D, 1] in place of the output head
      return layers + embed + 2 * d
    return layers + embed * (1 if self.tie_embeddings else 2) + d

  def num_expert_params(self) -> int:
    """The routed experts' parameters (all of them; the part mesh.expert splits)."""
    return self.num_moe_layers * 3 * self.d_model * self.expert_dim * self.num_experts

  def flops_per_token(self, streams: int = 1) -> int:
    """Training FLOPs per (real) token: 6 x (params - input embedding) + attention (full,
    bidirectional).

    DESIGN.md: 6 * (params - input embedding) + 12 * layers * seq * d_model. The attention term
    uses num_heads * head_dim, which equals d_model for the presets here. An MoE counts the
    active parameters: the experts a token runs through, so MFU is on active FLOPs. streams=2 is
    the block-diffusion step (config.attention_streams): the layers run on [x_t || x_0], two rows
    of a 2 * seq sequence per real token, the head on x_t's row only; attention is counted dense
    over the doubled sequence, as every mask kind is counted dense here.
    """
    head = self.vocab_size * self.d_model  # the head matmul costs 6*V*D per token, tied or not.
    non_embedding = self.num_params(active=True) - self.vocab_size * self.d_model
    if self.tie_embeddings:
      non_embedding += head
    layers = non_embedding - head
    attention = 12 * self.num_layers * streams * self.seq_len * self.num_heads * self.head_dim
    return 6 * (streams * layers + head) + streams * attention
