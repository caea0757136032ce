"""PEFT LoRA adapter directories <-> dlmjax's adapter tree (docs/lora.md, PEFT adapters).

A PEFT directory holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors with, per adapted nn.Linear, `base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r] (y = W x + (lora_alpha / r) B A x). Our A [L, *in, r] and
B [L, r, *out] flatten their in / out axes in the same C order as the weights they adapt
(checkpoint/hf_mapping.py), so one layer's lora_A is A[i] reshaped to [in, r] and transposed.
Exports use the names of the exported model's family; imports also read LLaDA's (d1's adapters).
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from dlmjax import config as config_lib
from dlmjax.checkpoint import hf_mapping, safetensors_io
from dlmjax.model import lora, score_head

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
_PREFIX = 'base_model.model.'
_SCORE_MODULE = hf_mapping.SCORE.removesuffix('.weight')  # a reward model's head (SEQ_CLS)
# Our adapted weights (train.lora.targets) and the hf_mapping slot of each.
_WEIGHTS = {
  'q': ('attn', 'q_proj'),
  'k': ('attn', 'k_proj'),
  'v': ('attn', 'v_proj'),
  'o': ('attn', 'o_proj'),
  'gate': ('mlp', 'gate_proj'),
  'up': ('mlp', 'up_proj'),
  'down': ('mlp', 'down_proj'),
}


def _module(naming, i: int, target: str) -> str:
  return naming.layer_name(i, target).removesuffix('.weight')


def _target_of(path) -> str:
  name = path[-1]
  return next(t for t, (_, w) in _WEIGHTS.items() if w == name)


def adapter_tensors(adapters: dict, cfg, family: str):
  """Yields (PEFT tensor name, float32 [r, in] or [out, r]) for every layer's adapters."""
  naming = hf_mapping.NAMINGS[family]
  runs = {key: (start, end) for key, _, start, end in cfg.layer_runs()}  # a path's first key
  for path, a, b in lora.adapted_weights(adapters):
    target = _target_of(path)
    a, b = np.asarray(jax.device_get(a), np.float32), np.asarray(jax.device_get(b), np.float32)
    start, end = runs[path[0]]
    for j, i in enumerate(range(start, end)):
      module = _PREFIX + _module(naming, i, target)
      yield module + '.lora_A.weight', np.ascontiguousarray(a[j].reshape(-1, a.shape[-1]).T)
      yield module + '.lora_B.weight', np.ascontiguousarray(b[j].reshape(b.shape[1], -1).T)


def write_adapter(
  output_dir: str, adapters: dict, cfg, *, base_model: str = '', dropout: float = 0.0
) -> str:
  """A PEFT adapter directory for the model `convert to-hf` exports (its family's names);
  dropout is the run's train.lora.dropout, so PEFT continues the training as it ran.

  A reward model's score head, trained whole, goes where PEFT saves a sequence-classification
  head (task_type SEQ_CLS, modules_to_save ['score']): `base_model.model.score.weight` [1, D],
  which PEFT loads over the base's head (ModulesToSaveWrapper)."""
  family = hf_mapping.export_family(cfg)
  naming = hf_mapping.NAMINGS[family]
  tensors = list(adapter_tensors(adapters, cfg, family))
  if cfg.score_head:
    score = np.asarray(jax.device_get(adapters[score_head.KEY]), np.float32).T
    tensors.append((_PREFIX + hf_mapping.SCORE, np.ascontiguousarray(score)))
  entries = [(name, t.shape, np.dtype(np.float32)) for name, t in tensors]
  safetensors_io.write_model(
    output_dir,
    entries,
    iter(tensors),
    max_shard_bytes=1 << 62,
    metadata={'format': 'pt'},
    single_file=WEIGHTS_FILE,
  )
  modules = [naming.layer_keys[t].split('.')[-2] for t in cfg.lora_targets]
  peft_config = dict(
    peft_type='LORA',
    task_type='SEQ_CLS' if cfg.score_head else None,
    base_model_name_or_path=base_model,
    inference_mode=True,
    r=cfg.lora_rank,
    lora_alpha=cfg.lora_alpha,
    lora_dropout=float(dropout),
    target_modules=sorted(modules),
    bias='none',
    fan_in_fan_out=False,
    use_rslora=False,
    use_dora=False,
    init_lora_weights=True,
    modules_to_save=[_SCORE_MODULE] if cfg.score_head else None,
  )
  with open(os.path.join(output_dir, CONFIG_FILE), 'w') as f:
    json.dump(peft_config, f, indent=2)
  return output_dir


def _fail(path: str, problem: str, fix: str):
  raise config_lib.ConfigError(f'train.lora.init_adapter={path!r}: {problem}; {fix}.')


def read_adapter(path: str, config, setup) -> dict:
  """The adapters of a PEFT directory in the setup's trainable shardings, checked against the
  run's rank, alpha, targets and model shapes (any family hf_mapping names, LLaDA's included).
  A reward run takes the adapter's score head (modules_to_save), else draws a fresh one as
  init_adapters does."""
  cfg = setup.model_config
  if len(cfg.layer_runs()) > 1:
    _fail(
      path,
      'is read into one stack of layers, the model has dense and MoE ones (model.moe.dense_layers)',
      'train the adapter from scratch, or use a model whose layers are all of one kind',
    )
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(config_path) or not os.path.exists(os.path.join(path, WEIGHTS_FILE)):
    _fail(path, f'no {CONFIG_FILE} and {WEIGHTS_FILE}', 'point it at a PEFT adapter directory')
  with open(config_path) as f:
    peft = json.load(f)
  if peft.get('peft_type', 'LORA') != 'LORA' or peft.get('use_dora') or peft.get('use_rslora'):
    _fail(path, 'is not a plain LoRA adapter (DoRA / rsLoRA)', 'use a plain LoRA adapter')
  if peft.get('rank_pattern') or peft.get('alpha_pattern'):
    _fail(path, 'has per-module ranks or alphas', 'use an adapter with one rank and alpha')
  if peft['r'] != cfg.lora_rank or float(peft['lora_alpha']) != cfg.lora_alpha:
    _fail(
      path,
      f'has r={peft["r"]}, lora_alpha={peft["lora_alpha"]}, the run {cfg.lora_rank}, '
      f'{cfg.lora_alpha}',
      f'set --config.train.lora.rank={peft["r"]} --config.train.lora.alpha={peft["lora_alpha"]}',
    )
  reader = safetensors_io.SafetensorsReader(os.path.join(path, WEIGHTS_FILE))
  index = {}  # PEFT module name -> (target, layer)
  for naming in hf_mapping.NAMINGS.values():
    for i in range(cfg.num_layers):
      for target in _WEIGHTS:
        if target in naming.layer_keys:  # an MoE family's MLP has no dense gate / up / down
          index[_PREFIX + _module(naming, i, target)] = (target, i)
  found, out = {}, {}  # found: (target, layer, 'A'|'B') -> array
  for name in reader.keys():
    if cfg.score_head and name == _PREFIX + hf_mapping.SCORE:  # a SEQ_CLS adapter's head
      out[score_head.KEY] = _score(path, reader.get(name), setup)
      continue
    module, _, kind = name.rpartition('.lora_')
    if kind not in ('A.weight', 'B.weight') or module not in index:
      _fail(
        path,
        f'holds {name}, which no {cfg.num_layers}-layer model of ours has',
        'use an adapter of this model (its layer count and projections)',
      )
    target, i = index[module]
    found[target, i, kind[0]] = reader.get(name)
  targets = sorted({t for t, _, _ in found})
  if targets != sorted(cfg.lora_targets):
    _fail(
      path,
      f'adapts {",".join(targets) or "nothing"}, the run {",".join(cfg.lora_targets)}',
      f'set --config.train.lora.targets={",".join(targets)}',
    )
  if cfg.score_head and score_head.KEY not in out:  # a language model's adapter: a fresh head
    fresh = score_head.fresh(config.seed, cfg.d_model, cfg.init_std)
    out[score_head.KEY] = jax.device_put(fresh, setup.trainable_shardings[score_head.KEY])
  for (parent, weight), shardings in _weights(setup):
    target = next(t for t, w in _WEIGHTS.items() if w == (parent, weight))
    for suffix, kind in ((lora.A_SUFFIX, 'A'), (lora.B_SUFFIX, 'B')):
      shape = setup.trainable_shapes['blocks'][parent][weight + suffix].shape
      layers = []
      for i in range(cfg.num_layers):
        t = found.get((target, i, kind))
        if t is None:
          _fail(path, f'has no lora_{kind} for layer {i} of {target}', 'use a complete adapter')
        if kind == 'A':
          want = (shape[-1], math.prod(shape[1:-1]))
          value = None if t.shape != want else t.T.reshape(shape[1:])
        else:
          want = (math.prod(shape[2:]), shape[1])
          value = None if t.shape != want else t.T.reshape(shape[1:])
        if value is None:
          _fail(
            path,
            f'lora_{kind} of {target} is {tuple(t.shape)}, this model needs {want}',
            'use an adapter of this model (same widths and rank)',
          )
        layers.append(np.asarray(value, np.float32))
      out.setdefault('blocks', {}).setdefault(parent, {})[weight + suffix] = jax.device_put(
        np.stack(layers), shardings[suffix]
      )
  return out


def _score(path: str, weight, setup):
  """A reward model's head [D, 1] from PEFT's `score.weight` [1, D]."""
  want = setup.trainable_shapes[score_head.KEY].shape
  if tuple(weight.shape) != want[::-1]:
    _fail(
      path,
      f'holds a score head of shape {tuple(weight.shape)}, this reward model needs {want[::-1]}',
      'use an adapter of this model (one label, the same width)',
    )
  value = np.asarray(weight, np.float32).T
  return jax.device_put(value, setup.trainable_shardings[score_head.KEY])


def _weights(setup):
  """((parent, weight), {suffix: sharding}) of every adapted weight of the setup."""
  blocks = setup.trainable_shardings['blocks']
  for parent, children in blocks.items():
    for key in children:
      if key.endswith(lora.A_SUFFIX):
        weight = key.removesuffix(lora.A_SUFFIX)
        yield (
          (parent, weight),
          {
            lora.A_SUFFIX: children[key],
            lora.B_SUFFIX: children[weight + lora.B_SUFFIX],
          },
        )
