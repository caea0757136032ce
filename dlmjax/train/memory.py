"""Will a config fit? Bytes per device from the config alone, checked against the GPU's memory.

The estimate (docs/scaling.md derives each term; calibrated on the H200 peaks in
docs/benchmarks.md, Memory per device: 0-15% above each, so it errs towards refusing):
  state        fp32 params + grads + Adam m, v = 16 bytes per parameter (20 with gradient
               accumulation over micro-batches), split over fsdp x tensor x pipeline x context
  activations  what the backward pass keeps per layer and token (by remat policy), for the
               device's tokens of one micro-batch and its layers (num_layers / pipeline)
  recompute    what a remat policy did not save, for one layer, rebuilt during its backward
  logits       fp32 logits and their gradient for one loss chunk (or all tokens without chunks)
`train` refuses a config whose estimate exceeds the device's usable memory, before compiling.

A LoRA run (train.lora.rank > 0) holds the frozen base in train.lora.base_dtype (bf16: 2 bytes per
parameter, int8: 1 per projection weight) and the 16 (20) bytes per parameter of state for its
adapters alone; with a float32 compute dtype over a bf16 base the step also casts the layers to
float32 (4 bytes per parameter). Its activations are the full model's (the backward still runs
through every layer). A stage may keep more copies of the params on the devices (its Stage's
resident_param_bytes: RL with a KL term, its reference in rl.reference_dtype, none with LoRA or
rl.reference_on_host).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.model import lora
from dlmjax.train import stages

GIB = 1024**3
# Memory per GPU as nvidia-smi reports it (GiB); first match of the device kind wins.
DEVICE_MEMORY_GIB = (
  ('GH200', 95.6),
  ('H200', 140.4),
  ('H100', 79.6),
  ('B200', 179.1),
  ('A100-SXM4-40GB', 40.0),
  ('A100', 80.0),
)
_DEFAULT_MEM_FRACTION = 0.75  # JAX preallocates this share unless XLA_PYTHON_CLIENT_MEM_FRACTION


def _saved_per_token_layer(
  cfg, remat: str, tensor: int, expert: int = 1, moe: bool | None = None
) -> float:
  """Elements kept per token and layer for the backward pass (compute dtype); moe: the layer's
  MLP is the MoE (default: whenever the model has experts; its dense_layers are not)."""
  d, f = cfg.d_model, cfg.ffn_dim / tensor
  if cfg.num_experts if moe is None else moe:  # per token: its experts' rows, gathered from the
    # `expert` group's devices
    f = (expert * cfg.experts_per_token + cfg.shared_experts) * cfg.expert_dim / tensor
  q, kv = cfg.num_heads * cfg.head_dim / tensor, cfg.num_kv_heads * cfg.head_dim / tensor
  with_attention_output = 3 * d + 2 * q + 2 * kv + 2 * f
  return {
    'full': d,  # the layer input only
    'save_dots': 3 * d + q + 2 * kv + 2 * f,  # input, q, k, v, out proj, gate, up, down
    'minimal': with_attention_output,  # the same plus the attention output
    'save_dots_attention': with_attention_output,  # the same (+ softmax stats, ~0)
    # + both norms' outputs, q and k after RoPE, the mid-layer stream, the SwiGLU product
    'save_activations': 6 * d + 3 * q + 3 * kv + 3 * f,
    'none': 10 * d + 3 * q + 4 * kv + 6 * f,  # everything (norms in fp32, rope, silu)
  }[remat]


def _per_layer_kinds(cfg, remat: str, tensor: int, expert: int) -> tuple[float, float]:
  """(elements saved per token, the mean over the layers; elements a layer's backward rebuilds,
  the largest layer's): an MoE model's dense layers (dense_layers) count their dense MLP's."""
  kinds = [(cfg.num_moe_layers, True), (cfg.num_layers - cfg.num_moe_layers, False)]
  kinds = [(n, moe) for n, moe in kinds if n]
  saved = [(n, _saved_per_token_layer(cfg, remat, tensor, expert, moe)) for n, moe in kinds]
  rebuilt = [
    _saved_per_token_layer(cfg, 'none', tensor, expert, moe)
    - _saved_per_token_layer(cfg, remat, tensor, expert, moe)
    for _, moe in kinds
  ]
  return sum(n * v for n, v in saved) / cfg.num_layers, max(rebuilt)


def estimate_bytes_per_device(config) -> dict[str, float]:
  """{'state', 'activations', 'recompute', 'logits', 'total'} in bytes, for a resolved mesh."""
  cfg = model_lib.ModelConfig.from_config(config)
  mesh = config.mesh
  context = mesh.get('context', 1)  # the axis exists once context parallelism lands
  shards = mesh.fsdp * mesh.tensor * mesh.pipeline * context
  per_param = 20 if config_lib.num_microbatches(config) > 1 else 16
  # Routed experts are split over `expert` too (model/moe.py), in the frozen base of a LoRA run
  # as well (its shardings come from the same logical axes; LoRA never adapts them).
  experts = cfg.num_expert_params()
  elsewhere = experts * (1 - 1 / mesh.expert)  # the experts other expert groups hold
  if config.train.lora.rank > 0:
    lora_cfg = lora.with_adapters(cfg, config)
    base_dtype = jnp.dtype(lora.storage_dtype(config))
    base = lora.base_bytes(lora_cfg, base_dtype.itemsize) - elsewhere * base_dtype.itemsize
    if jnp.dtype(cfg.dtype).itemsize > base_dtype.itemsize:  # the step's compute-dtype copy
      base += (cfg.num_params() - elsewhere) * jnp.dtype(cfg.dtype).itemsize
    state = (base + per_param * lora.num_adapter_params(lora_cfg)) / shards
  else:
    state = per_param * (cfg.num_params() - elsewhere) / shards
    resident = stages.build(config).resident_param_bytes  # e.g. RL's KL reference, not trained
    if resident:
      state += resident * (cfg.num_params() - elsewhere) / shards
  rows = config.train.micro_batch_size / config_lib.batch_parallelism(config)
  tokens = rows * cfg.seq_len / context
  streams = config_lib.attention_streams(config)  # block diffusion: layers on [x_t || x_0]
  act_bytes = 2 if cfg.dtype == 'bfloat16' else 4
  layers = cfg.num_layers / mesh.pipeline
  per_layer, rebuilt = _per_layer_kinds(cfg, cfg.remat, mesh.tensor, mesh.expert)
  saved = streams * tokens * layers * act_bytes * per_layer
  if cfg.attention_backend == 'xla':  # scores and probabilities in fp32, per head
    probs = streams**2 * tokens * cfg.num_heads / mesh.tensor * cfg.seq_len * 8
    saved += probs * (layers if cfg.remat == 'none' else 0)
  else:
    probs = 0.0
  recompute = 0.0
  if cfg.remat != 'none':  # one layer's worth of what the policy did not save, rebuilt at once
    recompute = streams * tokens * act_bytes * rebuilt + probs
  chunk_tokens = config.model.loss_chunk_tokens
  chunk = min(chunk_tokens, tokens) if chunk_tokens else tokens
  logits = 2 * chunk * cfg.vocab_size / mesh.tensor * 4
  total = state + saved + recompute + logits
  return dict(state=state, activations=saved, recompute=recompute, logits=logits, total=total)


def usable_fraction(env=None) -> float:
  env = os.environ if env is None else env
  return float(env.get('XLA_PYTHON_CLIENT_MEM_FRACTION') or _DEFAULT_MEM_FRACTION)


def device_memory_bytes(device_kind: str) -> float | None:
  """Usable bytes of one GPU of this kind (memory x JAX's preallocated share), or None."""
  for name, gib in DEVICE_MEMORY_GIB:
    if name.lower() in device_kind.lower():
      return gib * GIB * usable_fraction()
  return None


def present_device_memory_bytes() -> float | None:
  """What the first local device may allocate (None on CPU: no fixed per-device memory)."""
  device = jax.local_devices()[0]
  if device.platform == 'cpu':
    return None
  stats = device.memory_stats() or {}
  return stats.get('bytes_limit') or device_memory_bytes(device.device_kind)


def check_fits(config, capacity_bytes: float | None) -> dict[str, float]:
  """Raises ConfigError naming the knob when the estimate exceeds capacity (None: no check)."""
  estimate = estimate_bytes_per_device(config)
  if capacity_bytes is None or estimate['total'] <= capacity_bytes:
    return estimate
  gib = {k: v / GIB for k, v in estimate.items()}
  breakdown = (
    f'state {gib["state"]:.1f} + activations {gib["activations"]:.1f} + recompute '
    f'{gib["recompute"]:.1f} + logits {gib["logits"]:.1f}'
  )
  raise config_lib.ConfigError(
    f'the config needs about {gib["total"]:.1f} GiB per device ({breakdown}) but a device has '
    f'{capacity_bytes / GIB:.1f} GiB usable; {_advice(config, estimate)} '
    '(`python -m dlmjax.summary` shows the estimate; --config.train.check_memory=False skips '
    'this check).'
  )


def _advice(config, estimate) -> str:
  """The knob that removes the largest term."""
  m = config.model
  if estimate['activations'] + estimate['recompute'] >= estimate['state']:
    if m.remat != 'full':
      # From the heaviest policies, a middle step first: it keeps most of the speed.
      lighter = (
        'save_dots_attention or --config.model.remat=full'
        if m.remat in ('none', 'save_activations')
        else 'full'
      )
      return (
        f'save less for the backward pass with --config.model.remat={lighter} (now '
        f'{m.remat}), or lower --config.train.micro_batch_size'
      )
    return (
      'lower --config.train.micro_batch_size (gradient accumulation keeps the global '
      'batch), or split the sequence or layers with mesh.context / mesh.pipeline'
    )
  return (
    'shard the state over more devices: raise mesh.fsdp (use more GPUs, or move devices '
    'from mesh.data to mesh.fsdp), or add mesh.tensor / mesh.pipeline'
  )
