"""LoRA: low-rank adapters on the projections over a frozen base (docs/lora.md).

y = x W + (alpha / r) (x A) B with A [in, r] and B [r, out] beside each targeted projection W,
B zero at the start (so step 0 is the base model) and A uniform in +-1/sqrt(in), which is what
PEFT's kaiming_uniform(a=sqrt(5)) on its [r, in] lora_A weight draws. The adapter parameters
carry their base weight's logical axes (A its input axes, B its output axes), so every mesh
layout shards them the way it shards the weight they adapt.

Why not qwix (google/qwix 0.1.8, which imports and quantizes fine on jax 0.10.2 here): its LoRA
and quantization providers find the weight to adapt as a Flax module parameter that is the
right-hand operand of an intercepted einsum. Here the einsum's operand is a slice of a stacked,
scanned parameter, cast to the compute dtype before the scan (transformer._compute_weights), so
the lookup never matches; and its QArray leaves are no parameter leaves of the pure-dict train
state that optax, orbax and the converters read. The maths is a few lines, so it is written
once, in layers.project, and the base's int8 storage in model/quantize.py.

The parameter tree of a LoRA model is the base's plus `<weight>_lora_a` / `<weight>_lora_b`
beside each adapted weight; `split` separates the trainable adapters from the frozen base and
`combine` puts them back together.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax.model import choices, quantize, score_head

A_SUFFIX, B_SUFFIX = '_lora_a', '_lora_b'
_RANK_LETTER = 'r'  # the adapter's rank axis in the derived einsum equations
# train.lora.base_dtype: the frozen base in a float dtype, or quantised (model/quantize.py).
BASE_DTYPES = choices.LORA_BASE_DTYPES  # train.lora.base_dtype
PROJECTIONS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
_DROPOUT_STREAM = 0x10AD  # keeps the adapters' dropout keys apart from the masking streams

# Adapter dropout (train.lora.dropout, PEFT's lora_dropout): (key, rate) while the train step
# traces its forward, None otherwise (evaluation, sampling, RL scoring: dropout off). A context
# rather than an argument threaded through every stage's loss and the layers; the train step
# sets it, _run_layers folds in the layer's index, projection_operands the projection's.
_DROPOUT = contextvars.ContextVar('lora_dropout', default=None)


def dropout_key(seed: int, step, micro_index):
  """The step's dropout key: fold_in(seed, stream, step, micro-batch), so a resumed run draws
  the masks of the run it continues."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM), step)
  return jax.random.fold_in(key, micro_index)


@contextlib.contextmanager
def dropout(key, rate: float):
  """Adapter dropout of `rate` on for the forwards traced inside (rate 0: off)."""
  token = _DROPOUT.set((key, float(rate)) if rate > 0 else None)
  try:
    yield
  finally:
    _DROPOUT.reset(token)


def dropout_active() -> bool:
  return _DROPOUT.get() is not None


@contextlib.contextmanager
def dropout_layer(index):
  """Inside one layer of the stack: its index folded into the active key (no-op when off)."""
  active = _DROPOUT.get()
  token = _DROPOUT.set(
    None if active is None else (jax.random.fold_in(active[0], index), active[1])
  )
  try:
    yield
  finally:
    _DROPOUT.reset(token)


def projection_dropout(name: str):
  """(key, rate) of the adapter on projection `name` in the current layer, or None when off."""
  active = _DROPOUT.get()
  if active is None:
    return None
  return jax.random.fold_in(active[0], PROJECTIONS.index(name)), active[1]


def drop(x, key, rate: float):
  """PEFT's nn.Dropout on the adapter's input: each element zero w.p. rate, else x / (1 - rate)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Spec:
  """Which projections carry adapters, their rank and scale; rank 0 = none (full model)."""

  rank: int = 0
  alpha: float = 0.0
  targets: tuple[str, ...] = ()

  @property
  def factor(self) -> float:
    return self.alpha / self.rank

  def adapts(self, weight_name: str) -> bool:
    return self.rank > 0 and weight_name.removesuffix('_proj') in self.targets


def adapter_equations(equation: str) -> tuple[str, str]:
  """The projection einsum 'x,w->y' split into x A ('x,cr->kr') and (x A) B ('kr,ro->y'), where
  c are w's contracted letters, o its output letters and k the letters x keeps."""
  inputs, out = equation.split('->')
  lhs, rhs = inputs.split(',')
  contracted = ''.join(c for c in rhs if c in lhs and c not in out)
  kept = ''.join(c for c in lhs if c not in contracted)
  outputs = ''.join(c for c in rhs if c not in contracted)
  r = _RANK_LETTER
  return f'{lhs},{contracted}{r}->{kept}{r}', f'{kept}{r},{r}{outputs}->{out}'


def adapter_shapes(shape, axes, contract_ndim: int, rank: int, num_stacked: int):
  """((A shape, A axes), (B shape, B axes)) of a weight [layers?, *in, *out] with its axes."""
  lead = 1 if num_stacked else 0
  cut = lead + contract_ndim
  a = ((*shape[:cut], rank), (*axes[:cut], None))
  b = ((*shape[:lead], rank, *shape[cut:]), (*axes[:lead], None, *axes[cut:]))
  return a, b


def init_a(key, shape, contract_ndim: int):
  """PEFT's lora_A init: uniform in +-1/sqrt(fan_in) (kaiming_uniform with a = sqrt(5))."""
  fan_in = math.prod(shape[-1 - contract_ndim : -1])
  bound = 1.0 / math.sqrt(fan_in)
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


# Heads a LoRA run trains whole beside its adapters: a reward model's score head, new to the
# model (PEFT keeps a sequence-classification head in modules_to_save for the same reason).
TRAINED_WHOLE = (score_head.KEY,)


def is_adapter(name: str) -> bool:
  """A leaf a LoRA run trains: an adapter, or a head it trains whole (TRAINED_WHOLE)."""
  return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX) or name in TRAINED_WHOLE


def split(params: dict) -> tuple[dict, dict]:
  """(adapters, base) of a LoRA model's parameter tree; both keep the nesting."""
  adapters, base = {}, {}
  for key, value in params.items():
    if isinstance(value, dict):
      a, b = split(value)
      if a:
        adapters[key] = a
      if b:
        base[key] = b
    elif is_adapter(key):
      adapters[key] = value
    else:
      base[key] = value
  return adapters, base


def combine(adapters: dict, base: dict) -> dict:
  """The whole tree again (split's inverse); no array is copied."""
  out = dict(base)
  for key, value in adapters.items():
    out[key] = combine(value, base.get(key, {})) if isinstance(value, dict) else value
  return out


def adapted_weights(adapters: dict):
  """(path of the weight, A, B) per adapted weight; a path is e.g. ('blocks', 'attn', 'q_proj')."""
  found = []

  def walk(tree, path):
    for key, value in tree.items():
      if isinstance(value, dict):
        walk(value, (*path, key))
      elif key.endswith(A_SUFFIX):
        name = key.removesuffix(A_SUFFIX)
        found.append(((*path, name), value, tree[name + B_SUFFIX]))

  walk(adapters, ())
  return found


def delta(a, b, contract_ndim: int, factor: float):
  """(alpha / r) A B as a weight-shaped float32 array (A [L?, *in, r], B [L?, r, *out])."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  lead = a.ndim - 1 - contract_ndim
  in_shape, out_shape = a.shape[lead:-1], b.shape[lead + 1 :]
  a2 = a.reshape(*a.shape[:lead], math.prod(in_shape), a.shape[-1])
  b2 = b.reshape(*b.shape[:lead], b.shape[lead], math.prod(out_shape))
  merged = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST) * factor
  return merged.reshape(*a.shape[:lead], *in_shape, *out_shape)


def contract_ndim_of(name: str) -> int:
  """How many leading (after layers) axes of a projection weight its input spans: o_proj's two
  (heads, head_dim), every other one's one."""
  return 2 if name == 'o_proj' else 1


def merge_into_base(params: dict, spec: Spec) -> dict:
  """A float32 base tree with W + (alpha / r) A B in place of each adapted weight, no adapters
  (the merged model `convert to-hf` writes by default)."""
  adapters, base = split(params)
  base = quantize.dequantize_tree(base)
  base = jax.tree.map(lambda x: np.asarray(x, np.float32), base)
  base.update({k: np.asarray(adapters[k], np.float32) for k in TRAINED_WHOLE if k in adapters})
  for path, a, b in adapted_weights(adapters):
    node = base
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = np.asarray(
      node[path[-1]] + delta(a, b, contract_ndim_of(path[-1]), spec.factor), np.float32
    )
  return base


def freeze(base: dict, cfg, dtype) -> dict:
  """A float base tree (no adapters, as init_from restores it) in its frozen storage: the
  stacked projections int8, NF4 or int4 as cfg.weight_quant says (model/quantize.py), their
  scales and every other float leaf in dtype."""
  kind = cfg.weight_quant

  def walk(tree):
    out = {}
    for key, value in tree.items():
      if isinstance(value, dict):
        out[key] = walk(value)
      elif kind != 'none' and key.endswith('_proj') and value.ndim > 2:
        if kind == 'int8':
          q, scale = quantize.int8(value, tuple(range(1, 1 + contract_ndim_of(key))))
        else:
          q, scale = quantize.four_bit(value, quantize.last_input_axis(key), kind)
        out[key], out[key + quantize.SCALE_SUFFIXES[kind]] = q, scale.astype(dtype)
      else:
        out[key] = value.astype(dtype) if jnp.issubdtype(value.dtype, jnp.floating) else value
    return out

  return walk(base)


def with_adapters(base_config, config):
  """A ModelConfig with the run config's train.lora adapters and base storage (the same
  ModelConfig when train.lora.rank is 0)."""
  t = config.train.lora
  if t.rank <= 0:
    return base_config
  return dataclasses.replace(
    base_config,
    lora_rank=t.rank,
    lora_alpha=float(t.alpha),
    lora_targets=config_lib.lora_targets(config),
    weight_quant=t.base_dtype if t.base_dtype in quantize.KINDS else 'none',
  )


def storage_dtype(config):
  """The float dtype of a LoRA run's frozen base leaves (quantised weights keep their codes)."""
  return jnp.float32 if config.train.lora.base_dtype == 'float32' else jnp.bfloat16


def is_lora_run(config) -> bool:
  """A run config with adapters (runs saved before train.lora existed have none)."""
  return int(config.get('train', {}).get('lora', {}).get('rank', 0)) > 0


def num_adapter_params(cfg) -> int:
  """Trainable parameters of a ModelConfig's adapters: rank x (in + out) per target and layer."""
  if not cfg.lora_rank:
    return 0
  widths = config_lib.projection_widths(cfg)
  return sum(_layers_with(cfg, t) * cfg.lora_rank * sum(widths[t]) for t in cfg.lora_targets)


def _layers_with(cfg, target: str) -> int:
  """Layers holding the target's projection: every layer's attention, the dense MLP's gate, up
  and down only in the layers without experts (an MoE's experts take no adapters)."""
  if target in ('gate', 'up', 'down'):
    return cfg.num_layers - cfg.num_moe_layers
  return cfg.num_layers


def base_bytes(cfg, float_bytes: int) -> float:
  """Bytes of the frozen base: the projections in cfg.weight_quant's storage (int8 or 4-bit
  codes plus their float_bytes scales, model/quantize.py), every other parameter float_bytes."""
  total = cfg.num_params() * float_bytes
  if cfg.weight_quant == 'none':
    return total
  widths = config_lib.projection_widths(cfg)
  for name, (i, o) in widths.items():
    # int8 scales one output column over all inputs; 4-bit blocks run along the last input axis.
    along = cfg.head_dim if name == 'o' and cfg.weight_quant != 'int8' else i
    stored = quantize.bytes_per_weight(cfg.weight_quant, float_bytes, along)
    total -= _layers_with(cfg, name) * i * o * (float_bytes - stored)
  return total
