"""The model.* keys, LoRA's train.lora.* and the MoE keys on the resolved mesh, checked beside
the model that reads them (registered with dlmjax.config's validation registry); the choice
lists are model/choices.py's, jax-free like this module, so a config is checked before jax loads."""

from __future__ import annotations

from dlmjax.config import (
  ConfigError,
  dense_layers,
  lora_targets,
  parse_rope_scaling,
  projection_widths,
  registry,
)
from dlmjax.kernels import choices as kernel_choices
from dlmjax.model import choices

registry.choices('model.attention_mask', choices.ATTENTION_MASKS)
registry.choices('model.attention_backend', choices.ATTENTION_BACKENDS)
registry.choices('model.norm_backend', choices.NORM_BACKENDS)
registry.choices('model.dtype', choices.COMPUTE_DTYPES)
registry.choices('model.matmul_dtype', choices.MATMUL_DTYPES)
registry.choices('model.remat', choices.REMAT_POLICIES)
registry.choices('model.moe.router', choices.MOE_ROUTERS)
registry.choices('model.moe.backend', kernel_choices.GROUPED_MATMUL_BACKENDS)
registry.choices('model.moe.exchange', choices.MOE_EXCHANGES)


@registry.check
def model_shapes_and_backends(config):
  m = config.model
  for key in (
    'num_layers',
    'd_model',
    'num_heads',
    'num_kv_heads',
    'head_dim',
    'ffn_dim',
    'vocab_size',
    'seq_len',
  ):
    if m[key] <= 0:
      raise ConfigError(f'model.{key}={m[key]} must be positive.')
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(
      f'model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads='
      f'{m.num_kv_heads}; grouped-query attention needs whole groups.'
    )
  if m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for rotary embeddings.')
  parse_rope_scaling(m.rope_scaling)
  rope_dim = int(m.head_dim * m.rope_fraction)
  if not 0 < m.rope_fraction <= 1 or rope_dim < 2 or rope_dim % 2:
    raise ConfigError(
      f'model.rope_fraction={m.rope_fraction} must be in (0, 1] and rotate an even number of '
      f'dims of model.head_dim={m.head_dim} (int(head_dim x fraction) = {rope_dim}).'
    )
  if m.loss_chunk_tokens < 0:
    raise ConfigError(
      f'model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 0 (0 = full logits).'
    )
  for key in ('mask_token_id', 'eos_token_id', 'pad_token_id'):
    if not 0 <= m[key] < m.vocab_size:
      raise ConfigError(
        f'model.{key}={m[key]} is outside the vocabulary [0, {m.vocab_size}); '
        f"set it to the tokenizer's id."
      )
  if m.attention_mask == 'block_causal' and m.seq_len % m.block_size:
    raise ConfigError(
      f'model.seq_len={m.seq_len} is not a multiple of model.block_size='
      f'{m.block_size}; block-causal attention needs whole blocks.'
    )
  if m.attention_backend == 'cudnn' and m.attention_mask == 'block_causal':
    raise ConfigError(
      'model.attention_backend=cudnn cannot express block_causal masks without a '
      'dense mask; use --config.model.attention_backend=pallas (or auto, or xla).'
    )
  if config.data.packing and m.attention_backend == 'cudnn':
    raise ConfigError(
      'data.packing=True needs per-document attention, which the cudnn backend '
      'could only do with a dense mask; use '
      '--config.model.attention_backend=pallas (or auto), '
      '--config.model.attention_backend=xla or --config.data.packing=False.'
    )
  # Pallas flash attention (dlmjax/kernels/flash_attention.py): Triton tiles are powers of two.
  if m.attention_backend == 'pallas' and (m.head_dim < 16 or m.head_dim & (m.head_dim - 1)):
    raise ConfigError(
      f'model.attention_backend=pallas needs a power-of-two model.head_dim >= 16, '
      f'got {m.head_dim}; use --config.model.attention_backend=auto (or xla).'
    )
  if m.norm_backend == 'pallas':  # kernels/rms_norm.py: Triton tiles are powers of two.
    for key in ('d_model', 'head_dim', 'num_heads', 'num_kv_heads'):
      if m[key] & (m[key] - 1):
        raise ConfigError(
          f'model.norm_backend=pallas needs a power-of-two model.{key}, got '
          f'{m[key]}; use --config.model.norm_backend=auto (or xla).'
        )


@registry.check
def lora_adapters(config):
  """train.lora.*: adapters need a base to adapt and ranks the projections can hold."""
  lora, m = config.train.lora, config.model
  if lora.rank < 0:
    raise ConfigError(f'train.lora.rank={lora.rank} must be >= 0 (0 = full fine-tuning).')
  if lora.rank == 0:
    if lora.init_adapter:
      raise ConfigError(
        f'train.lora.init_adapter={lora.init_adapter!r} needs adapters: set '
        "--config.train.lora.rank (the adapter's own rank)."
      )
    return
  if not config.init_from:
    raise ConfigError(
      'train.lora.rank > 0 trains adapters on a frozen base model: set --config.init_from to '
      'a dlmjax run, step or Hugging Face directory (or train.lora.rank=0 to train every weight).'
    )
  if lora.base_dtype not in choices.LORA_BASE_DTYPES:
    raise ConfigError(
      f'train.lora.base_dtype={lora.base_dtype!r} is not one of {choices.LORA_BASE_DTYPES}.'
    )
  if lora.base_dtype in ('nf4', 'int4'):
    # 4-bit codes pack two per byte in blocks of 64 (or the whole axis, when shorter) along each
    # projection's last input axis: d_model, ffn_dim and head_dim (model/quantize.py).
    for key in ('d_model', 'ffn_dim', 'head_dim'):
      n = m[key]
      if n % 2 or (n > 64 and n % 64):
        raise ConfigError(
          f'train.lora.base_dtype={lora.base_dtype} stores blocks of 64 inputs: model.{key}={n} '
          'is not even and a multiple of 64 (or below 64); use base_dtype=int8 or bfloat16.'
        )
  if not 0 <= lora.dropout < 1:
    raise ConfigError(f'train.lora.dropout={lora.dropout} must be in [0, 1) (PEFT: 0.05).')
  if lora.dropout > 0 and config.mesh.pipeline > 1:
    raise ConfigError(
      f'train.lora.dropout={lora.dropout} draws its masks per layer of the whole stack, which '
      'the pipeline splits into stages: set --config.mesh.pipeline=1 or train.lora.dropout=0.'
    )
  if lora.alpha <= 0:
    raise ConfigError(f'train.lora.alpha={lora.alpha} must be positive.')
  names = lora_targets(config)
  widths = projection_widths(m)
  unknown = [t for t in names if t not in widths]
  if unknown or not names:
    raise ConfigError(
      f'train.lora.targets={lora.targets!r} names {unknown or "nothing"}; use a '
      f'comma-separated subset of {",".join(widths)}.'
    )
  for target in names:
    if lora.rank > min(widths[target]):
      raise ConfigError(
        f"train.lora.rank={lora.rank} exceeds the {target} projection's width "
        f'{min(widths[target])} ({widths[target][0]} -> {widths[target][1]}); lower '
        '--config.train.lora.rank or drop the target.'
      )


@registry.check(phase='mesh')
def experts(config, num_devices):
  """The MoE keys (on a resolved mesh)."""
  del num_devices  # the mesh is resolved for it already
  m, mesh = config.model, config.mesh
  e = m.moe
  if e.num_experts < 0 or e.ffn_dim < 0 or e.shared_experts < 0:
    raise ConfigError(
      'model.moe.num_experts, model.moe.ffn_dim and model.moe.shared_experts must be >= 0 (0 = '
      'dense, model.ffn_dim, none).'
    )
  for key in ('balance_loss', 'z_loss', 'bias_rate'):
    if e[key] < 0:
      raise ConfigError(f'model.moe.{key}={e[key]} must be >= 0 (0 = off).')
  dense = dense_layers(m)
  if dense and not e.num_experts:
    raise ConfigError(
      f'model.moe.dense_layers={e.dense_layers!r} marks dense layers of an MoE model, but '
      "model.moe.num_experts=0 (every layer is dense); set --config.model.moe.dense_layers=''."
    )
  outside = [i for i in dense if not 0 <= i < m.num_layers]
  if outside:
    raise ConfigError(
      f'model.moe.dense_layers={e.dense_layers!r} names layers {outside} outside [0, '
      f'model.num_layers={m.num_layers}); list indices below {m.num_layers}.'
    )
  if dense and len(dense) == m.num_layers:
    raise ConfigError(
      f'model.moe.dense_layers={e.dense_layers!r} makes every layer dense; set '
      "--config.model.moe.num_experts=0 and --config.model.moe.dense_layers=''."
    )
  if not e.num_experts:
    if mesh.expert > 1:
      raise ConfigError(
        f'mesh.expert={mesh.expert} splits MoE experts but model.moe.num_experts=0; set '
        '--config.mesh.expert=1 or give the model experts.'
      )
    return
  if not 0 < e.experts_per_token <= e.num_experts:
    raise ConfigError(
      f'model.moe.experts_per_token={e.experts_per_token} must be in [1, model.moe.num_experts='
      f'{e.num_experts}]; set --config.model.moe.experts_per_token to at most {e.num_experts}.'
    )
  _router_groups(e)
  if e.num_experts % mesh.expert:
    raise ConfigError(
      f'model.moe.num_experts={e.num_experts} is not divisible by mesh.expert={mesh.expert}; '
      'pick an expert size that divides it.'
    )
  if (e.ffn_dim or m.ffn_dim) % mesh.tensor:
    raise ConfigError(
      f'the expert width (model.moe.ffn_dim or model.ffn_dim) is not divisible by mesh.tensor='
      f'{mesh.tensor}; pick a tensor size that divides it.'
    )
  if dense and mesh.pipeline > 1:
    raise ConfigError(
      f'pipeline stages split one stack of identical layers, but model.moe.dense_layers='
      f'{e.dense_layers!r} mixes dense and MoE layers; set --config.mesh.pipeline=1.'
    )
  if m.matmul_dtype != 'compute':
    raise ConfigError(
      f'model.matmul_dtype={m.matmul_dtype} does not cover the MoE experts; set '
      '--config.model.matmul_dtype=compute.'
    )


def _router_groups(e):
  """model.moe.router_groups / router_group_topk / routed_scale of an MoE model."""
  groups, topk = e.router_groups, e.router_group_topk
  if groups < 1 or e.num_experts % groups or not 1 <= topk <= groups:
    raise ConfigError(
      f'model.moe.router_groups={groups} must divide model.moe.num_experts={e.num_experts} and '
      f'model.moe.router_group_topk={topk} be in [1, router_groups].'
    )
  if groups > 1 and e.router != 'sigmoid_bias':
    raise ConfigError(
      f'model.moe.router_groups={groups} limits the sigmoid_bias router only; set '
      '--config.model.moe.router=sigmoid_bias or --config.model.moe.router_groups=1.'
    )
  if e.experts_per_token > topk * (e.num_experts // groups):
    raise ConfigError(
      f'model.moe.experts_per_token={e.experts_per_token} exceeds the {topk} x '
      f'{e.num_experts // groups} experts of the kept groups; raise model.moe.router_group_topk.'
    )
  if not e.routed_scale > 0:
    raise ConfigError(f'model.moe.routed_scale={e.routed_scale} must be > 0 (1 = unscaled).')
  if e.block_experts and not e.experts_per_token <= e.block_experts <= e.num_experts:
    raise ConfigError(
      f'model.moe.block_experts={e.block_experts} must lie in [experts_per_token='
      f'{e.experts_per_token}, num_experts={e.num_experts}] (0 = per-token routing); set '
      '--config.model.moe.block_experts accordingly.'
    )
