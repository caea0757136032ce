"""The one map between dlmjax's parameter dict and Hugging Face tensor names and layouts.

Ours: one array per parameter kind stacked over layers (leading axis L; an MoE model with dense
layers stacks each run of layers of one kind under its own key, ModelConfig.layer_runs, and
layer i's tensors come from its run's slice), attention kernels split
by head ([D, N, H], [N, H, D]), matmul kernels as [in, out]. Hugging Face: one tensor per layer,
nn.Linear weights as [out, in]. Both directions stream: export yields one HF tensor at a time;
import fills each stacked array from one HF tensor at a time, so a model is never held twice.

Exports use the names of the layout asked for (hf_layouts; by default the family of the model's
options, hf_config.export_family: Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama with
neither). Imports read the names of every architecture in
hf_config.ARCHITECTURES into a model with the same options (model.qk_norm, model.qkv_bias); what a
checkpoint has that our model cannot express (a non-zero bias it has no slot for, a missing QK-norm)
is refused with the reason, never silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from dlmjax.checkpoint import families
from dlmjax.checkpoint import hf_config
from dlmjax.model.presets import ModelConfig

MISSING_QK_NORM = ('error', 'ones')


class MappingError(ValueError):
  """Tensors that do not fit the model: names the tensor, what was expected and what was found."""


Naming = families.base.Naming
# Each family's tensor names (checkpoint/families: its module's Naming).
NAMINGS = {name: family.names for name, family in families.FAMILIES.items()}

# Our per-layer slots: path in the param dict and layout kind.
#   vector:    [X]        <-> [X]
#   in_heads:  [D, X, H]  <-> [X*H, D]   (q/k/v: nn.Linear(D, X*H))
#   heads_out: [N, H, D]  <-> [D, N*H]   (o:     nn.Linear(N*H, D))
#   matrix:    [I, O]     <-> [O, I]     (MLP)
#   bias:      [X, H]     <-> [X*H]      (q/k/v biases)
#   experts:   [E, I, O]  <-> E tensors [O, I], one per expert (`{e}` in the name)
_SLOTS = {
  'input_norm': (('blocks', 'input_norm', 'scale'), 'vector'),
  'q': (('blocks', 'attn', 'q_proj'), 'in_heads'),
  'q_bias': (('blocks', 'attn', 'q_bias'), 'bias'),
  'k': (('blocks', 'attn', 'k_proj'), 'in_heads'),
  'k_bias': (('blocks', 'attn', 'k_bias'), 'bias'),
  'v': (('blocks', 'attn', 'v_proj'), 'in_heads'),
  'v_bias': (('blocks', 'attn', 'v_bias'), 'bias'),
  'q_norm': (('blocks', 'attn', 'q_norm', 'scale'), 'vector'),
  'k_norm': (('blocks', 'attn', 'k_norm', 'scale'), 'vector'),
  'o': (('blocks', 'attn', 'o_proj'), 'heads_out'),
  'post_attn_norm': (('blocks', 'post_attn_norm', 'scale'), 'vector'),
  'gate': (('blocks', 'mlp', 'gate_proj'), 'matrix'),
  'up': (('blocks', 'mlp', 'up_proj'), 'matrix'),
  'down': (('blocks', 'mlp', 'down_proj'), 'matrix'),
  'router': (('blocks', 'mlp', 'router_kernel'), 'matrix'),
  'router_bias': (('blocks', 'mlp', 'router_bias'), 'vector'),
  'expert_gate': (('blocks', 'mlp', 'gate_proj'), 'experts'),
  'expert_up': (('blocks', 'mlp', 'up_proj'), 'experts'),
  'expert_down': (('blocks', 'mlp', 'down_proj'), 'experts'),
  'shared_gate': (('blocks', 'mlp', 'shared', 'gate_proj'), 'matrix'),
  'shared_up': (('blocks', 'mlp', 'shared', 'up_proj'), 'matrix'),
  'shared_down': (('blocks', 'mlp', 'shared', 'down_proj'), 'matrix'),
}
_EMBED, _FINAL_NORM, _LM_HEAD = ('embed_tokens',), ('final_norm', 'scale'), ('lm_head',)
SCORE = 'score.weight'  # transformers' *ForSequenceClassification head [num_labels, D]
_QK_NORM_SLOTS = ('q_norm', 'k_norm')
_BIAS_SLOTS = ('q_bias', 'k_bias', 'v_bias')
_DENSE_SLOTS = ('gate', 'up', 'down')
_EXPERT_SLOTS = ('router', 'expert_gate', 'expert_up', 'expert_down')
_SHARED_SLOTS = ('shared_gate', 'shared_up', 'shared_down')


def layer_slots(cfg: ModelConfig, i: int) -> list[str]:
  """The slots layer i of our model of `cfg` has (QK-norm and biases only where switched on; the
  dense MLP's or the experts', with the shared experts' when there are any)."""
  mlp = _DENSE_SLOTS
  if cfg.is_moe_layer(i):
    mlp = (
      *_EXPERT_SLOTS,
      *(('router_bias',) if cfg.router == 'sigmoid_bias' else ()),
      *(_SHARED_SLOTS if cfg.shared_experts else ()),
    )
  every_mlp = (*_DENSE_SLOTS, *_EXPERT_SLOTS, 'router_bias', *_SHARED_SLOTS)
  return [
    s
    for s in _SLOTS
    if (cfg.qk_norm or s not in _QK_NORM_SLOTS)
    and (cfg.qkv_bias or s not in _BIAS_SLOTS)
    and (s in mlp or s not in every_mlp)
  ]


def model_slots(cfg: ModelConfig) -> list[str]:
  """The slots any layer of our model has (a mixed model's dense and MoE ones together)."""
  every = {s for i in range(cfg.num_layers) for s in layer_slots(cfg, i)}
  return [s for s in _SLOTS if s in every]


def _path(cfg: ModelConfig, i: int, slot: str) -> tuple[tuple, int]:
  """(path of layer i's slot in our params, its index on the stack): the path's first key is the
  layer's run of one kind (ModelConfig.layer_runs; `blocks` when all layers are one kind)."""
  key, j = cfg.layer_location(i)
  return (key, *_SLOTS[slot][0][1:]), j


def export_family(cfg: ModelConfig) -> str:
  """The Hugging Face family whose layout holds exactly our model (hf_config.export_family; an
  MoE model: Qwen3-MoE's when it has QK-norm and no shared experts, else LLaDA-MoE's)."""
  if cfg.num_experts:
    return hf_config.moe_family(
      router=cfg.router, qk_norm=cfg.qk_norm, shared_experts=cfg.shared_experts
    )
  return hf_config.export_family(
    qk_norm=cfg.qk_norm, qkv_bias=cfg.qkv_bias, shift_logits=cfg.shift_logits
  )


def _hf_shape(shape, layout):
  if layout == 'experts':  # each expert's tensor
    return (shape[2], shape[1])
  if layout == 'vector':
    return tuple(shape)
  if layout == 'bias':
    return (shape[0] * shape[1],)
  if layout == 'in_heads':
    return (shape[1] * shape[2], shape[0])
  if layout == 'heads_out':
    return (shape[2], shape[0] * shape[1])
  return (shape[1], shape[0])


def _to_hf(array, layout):
  if layout == 'vector':
    return array
  if layout == 'bias':
    return array.reshape(-1)
  if layout == 'in_heads':
    return array.reshape(array.shape[0], -1).T
  if layout == 'heads_out':
    return array.reshape(-1, array.shape[-1]).T
  return array.T


def _from_hf(tensor, layout, shape):
  if layout == 'vector':
    return tensor
  if layout == 'bias':
    return tensor.reshape(shape)
  return tensor.T.reshape(shape)


def _layer_shapes(cfg: ModelConfig) -> dict:
  """Per-layer shape of each slot (our layout, without the layer axis)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  return dict(
    input_norm=(d,),
    q=(d, n, h),
    k=(d, k, h),
    v=(d, k, h),
    q_bias=(n, h),
    k_bias=(k, h),
    v_bias=(k, h),
    q_norm=(h,),
    k_norm=(h,),
    o=(n, h, d),
    post_attn_norm=(d,),
    gate=(d, f),
    up=(d, f),
    down=(f, d),
    router=(d, cfg.num_experts),
    router_bias=(cfg.num_experts,),
    expert_gate=(cfg.num_experts, d, cfg.expert_dim),
    expert_up=(cfg.num_experts, d, cfg.expert_dim),
    expert_down=(cfg.num_experts, cfg.expert_dim, d),
    shared_gate=(d, cfg.shared_experts * cfg.expert_dim),
    shared_up=(d, cfg.shared_experts * cfg.expert_dim),
    shared_down=(cfg.shared_experts * cfg.expert_dim, d),
  )


def _layer_tensors(naming: Naming, cfg: ModelConfig, i: int, slot: str) -> list[tuple]:
  """(Hugging Face name, shape, expert index or None) of the tensors that hold layer i's slot:
  one, or one per expert."""
  layout = _SLOTS[slot][1]
  shape = _hf_shape(_layer_shapes(cfg)[slot], layout)
  if layout == 'experts':
    return [(naming.layer_name(i, slot, e), shape, e) for e in range(cfg.num_experts)]
  return [(naming.layer_name(i, slot), shape, None)]


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------------------------
# Export: our params -> Hugging Face tensors of a layout's names (hf_layouts)


def _export_naming(cfg: ModelConfig, names: str | None) -> Naming:
  """The names an export writes: NAMINGS[names] (a layout's, hf_layouts), else the family the
  model's options choose."""
  return NAMINGS[names or export_family(cfg)]


def _layer_exports(naming: Naming, cfg: ModelConfig, i: int) -> list[tuple[str, tuple]]:
  """(name, slots) of layer i's exported tensors in order: one slot each, or the slots of a
  joined tensor (Naming.joined) that the layer has, under the joined name at its first slot."""
  slots = layer_slots(cfg, i)
  out = []
  for slot in slots:
    group = naming.joined_group(slot)
    if group is None:
      out.append((naming.layer_name(i, slot), (slot,)))
      continue
    present = tuple(s for s in group[1] if s in slots)
    if slot == present[0]:
      out.append((naming.layer.format(i=i) + group[0], present))
  return out


def export_entries(
  cfg: ModelConfig, *, vocab_rows: int, names: str | None = None
) -> list[tuple[str, tuple]]:
  """(name, shape) of every exported tensor, in the order export_tensors yields them."""
  naming = _export_naming(cfg, names)
  entries = [(naming.embed, (vocab_rows, cfg.d_model))]
  shapes = _layer_shapes(cfg)
  for i in range(cfg.num_layers):
    for joined, slots in _layer_exports(naming, cfg, i):
      if len(slots) > 1:
        parts = [_hf_shape(shapes[s], _SLOTS[s][1]) for s in slots]
        entries.append((joined, (sum(p[0] for p in parts), *parts[0][1:])))
        continue
      entries += [(name, shape) for name, shape, _ in _layer_tensors(naming, cfg, i, slots[0])]
  entries.append((naming.final_norm, (cfg.d_model,)))
  if cfg.score_head:  # a reward model: *ForSequenceClassification's score, no output head
    entries.append((SCORE, (1, cfg.d_model)))
  elif not cfg.tie_embeddings:  # tied: transformers re-creates lm_head from the embedding.
    entries.append((naming.lm_head, (vocab_rows, cfg.d_model)))
  return entries


def export_tensors(
  params: dict, cfg: ModelConfig, *, vocab_rows: int, to_host=np.asarray, names: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (Hugging Face name, float32 numpy array), one tensor at a time.

  `vocab_rows` <= the padded vocab: the padded size keeps every row (MegaDLMs exports the padded
  50304), the tokenizer's size drops the padding. `to_host` turns one (possibly sharded, on-device)
  array into numpy; only that slice is ever on the host. `names`: a key of NAMINGS (default: the
  family of the model's options).
  """
  if not 0 < vocab_rows <= cfg.vocab_size:
    raise MappingError(f'vocab_rows={vocab_rows} must be in (0, {cfg.vocab_size}].')
  naming = _export_naming(cfg, names)
  # No named intermediates: a host copy that is transposed into a new array is freed before the
  # yield, so the generator never holds two copies of one tensor.
  yield naming.embed, np.asarray(to_host(_get(params, _EMBED)[:vocab_rows]), np.float32)

  def host(slot, i):
    path, j = _path(cfg, i, slot)
    return _to_hf(np.asarray(to_host(_get(params, path)[j]), np.float32), _SLOTS[slot][1])

  for i in range(cfg.num_layers):
    for joined, slots in _layer_exports(naming, cfg, i):
      if len(slots) > 1:  # one tensor stacking the slots' rows (Naming.joined)
        yield joined, np.concatenate([host(s, i) for s in slots], axis=0)
        continue
      slot = slots[0]
      layout = _SLOTS[slot][1]
      path, j = _path(cfg, i, slot)
      if layout == 'experts':  # one layer's experts on the host, one expert's tensor yielded
        experts = np.asarray(to_host(_get(params, path)[j]), np.float32)
        for name, _, e in _layer_tensors(naming, cfg, i, slot):
          yield name, np.ascontiguousarray(experts[e].T)
        del experts
        continue
      yield naming.layer_name(i, slot), np.ascontiguousarray(host(slot, i))
  yield naming.final_norm, np.asarray(to_host(_get(params, _FINAL_NORM)), np.float32)
  if cfg.score_head:
    yield SCORE, np.ascontiguousarray(np.asarray(to_host(params['score']), np.float32).T)
  elif not cfg.tie_embeddings:
    yield (
      naming.lm_head,
      np.ascontiguousarray(
        np.asarray(to_host(_get(params, _LM_HEAD)[:, :vocab_rows]), np.float32).T
      ),
    )


# ----------------------------------------------------------------------------------------------
# Import: Hugging Face tensors -> our params


class DictSource:
  """A tensor source over an in-memory mapping (a torch state dict, numpy arrays)."""

  def __init__(self, tensors: dict, to_numpy=np.asarray):
    self._tensors, self._to_numpy = tensors, to_numpy

  def keys(self):
    return list(self._tensors)

  def __contains__(self, name):
    return name in self._tensors

  def shape(self, name):
    return tuple(self._tensors[name].shape)

  def get(self, name):
    return self._to_numpy(self._tensors[name])


def _source_slots(naming: Naming, cfg: ModelConfig, i: int) -> list[str]:
  """Layer i's slots that the checkpoint holds (a QK-norm it lacks is filled with ones)."""
  return [s for s in layer_slots(cfg, i) if s in naming.layer_keys]


def _expected(naming: Naming, cfg: ModelConfig) -> list[str]:
  names = [naming.embed, naming.final_norm]
  if not cfg.tie_embeddings:
    names.append(naming.lm_head)
  names += [
    name
    for i in range(cfg.num_layers)
    for s in _source_slots(naming, cfg, i)
    for name, _, _ in _layer_tensors(naming, cfg, i, s)
  ]
  return names


def _zero_bias_names(naming: Naming, cfg: ModelConfig) -> list[str]:
  """Biases (and other tensors, Naming.zero_tensors) the checkpoint may carry that the model has
  no slot for (q/k/v biases fill model.qkv_bias's slots when it is on)."""
  return [
    naming.layer_name(i, s)[: -len('weight')] + 'bias'
    for i in range(cfg.num_layers)
    for s in naming.bias_slots
    if not (cfg.qkv_bias and f'{s}_bias' in naming.layer_keys)
  ] + [naming.layer.format(i=i) + t for i in range(cfg.num_layers) for t in naming.zero_tensors]


class _UnfusedExperts:
  """A tensor source that shows a checkpoint's fused expert tensors (Naming.fused) under the
  per-expert names, reading each fused tensor once while its experts are taken (the last one
  read is kept), and each joined tensor's row blocks (Naming.joined) under its slots' names."""

  def __init__(self, source, naming: Naming, cfg: ModelConfig):
    self._source, self._virtual, self._cached = source, {}, (None, None)
    present = set(source.keys())
    self._hidden = set()
    self._rows = {}  # a joined tensor's slot name -> (joined name, first row, end row)
    shapes = _layer_shapes(cfg)
    for i in range(cfg.num_layers):
      for suffix, slots in naming.joined:
        joined = naming.layer.format(i=i) + suffix
        if joined not in present:
          continue
        self._hidden.add(joined)
        start = 0
        for slot in (s for s in slots if s in layer_slots(cfg, i)):
          rows = _hf_shape(shapes[slot], _SLOTS[slot][1])[0]
          self._rows[naming.layer_name(i, slot)] = (joined, start, start + rows)
          start += rows
        if start != source.shape(joined)[0]:
          raise MappingError(
            f'{joined} has {source.shape(joined)[0]} rows, expected {start} from the model '
            'config (num_heads, num_kv_heads, head_dim).'
          )
    for i in range(cfg.num_layers):
      for suffix, parts in naming.fused:
        fused = naming.layer.format(i=i) + suffix
        if fused not in present:
          continue
        self._hidden.add(fused)
        shape = source.shape(fused)
        rows = shape[1] // len(parts)
        for slot, half in parts:
          for e in range(shape[0]):
            self._virtual[naming.layer_name(i, slot, e)] = (fused, e, half, (rows, *shape[2:]))

  def keys(self):
    shown = [n for n in self._source.keys() if n not in self._hidden]
    return shown + list(self._virtual) + list(self._rows)

  def __contains__(self, name):
    return (
      name in self._virtual
      or name in self._rows
      or (name not in self._hidden and name in self._source)
    )

  def shape(self, name):
    if name in self._virtual:
      return self._virtual[name][3]
    if name in self._rows:
      joined, start, end = self._rows[name]
      return (end - start, *self._source.shape(joined)[1:])
    return self._source.shape(name)

  def get(self, name):
    if name in self._rows:
      joined, start, end = self._rows[name]
      return np.asarray(self._source.get(joined))[start:end]
    if name not in self._virtual:
      return self._source.get(name)
    fused, e, half, (rows, *_) = self._virtual[name]
    if self._cached[0] != fused:
      self._cached = (None, None)  # drop the previous one before reading the next
      self._cached = (fused, np.asarray(self._source.get(fused)))
    tensor = self._cached[1][e]
    return tensor if half is None else tensor[half * rows : (half + 1) * rows]


def _unfused(source, naming: Naming, cfg: ModelConfig):
  if not (naming.fused or naming.joined) or isinstance(source, _UnfusedExperts):
    return source
  return _UnfusedExperts(source, naming, cfg)


def _listing(names, limit=8) -> str:
  shown = ', '.join(names[:limit])
  return shown + (f' and {len(names) - limit} more' if len(names) > limit else '')


def check_source(
  source, arch: str, cfg: ModelConfig, *, vocab_size: int, missing_qk_norm: str = 'error'
) -> None:
  """Raises MappingError for missing, unexpected or misshaped tensors, before reading any data."""
  if arch not in NAMINGS:
    raise MappingError(f'unknown architecture {arch!r}; known: {", ".join(NAMINGS)}.')
  if missing_qk_norm not in MISSING_QK_NORM:
    raise MappingError(f'missing_qk_norm={missing_qk_norm!r} is not one of {MISSING_QK_NORM}.')
  naming = NAMINGS[arch]
  if cfg.qk_norm and 'q_norm' not in naming.layer_keys and missing_qk_norm == 'error':
    raise MappingError(
      f'{arch} has no QK-norm, but the model has model.qk_norm=True (RMSNorm on q and k per '
      'head before RoPE), so these weights would compute a different function. Import with '
      'model.qk_norm=False (what converting without --config derives for this family), or, to '
      'use them as the start of further training of a QK-norm model, convert with '
      '--missing-qk-norm=ones (unit q/k norm scales; expect a higher loss at first).'
    )
  if cfg.qkv_bias and 'q_bias' not in naming.layer_keys:
    raise MappingError(
      f'{arch} checkpoints have no q/k/v biases, but the model has model.qkv_bias=True; '
      'import with model.qkv_bias=False.'
    )
  lacking = [s for s in model_slots(cfg) if s not in naming.layer_keys and s not in _QK_NORM_SLOTS]
  if lacking:
    raise MappingError(
      f"the {arch} layout has no place for the model's {', '.join(lacking)} weights (e.g. shared "
      'experts, model.moe.shared_experts > 0); import into a model without them.'
    )
  source = _unfused(source, naming, cfg)
  expected = _expected(naming, cfg)
  present = set(source.keys())
  if cfg.score_head and SCORE in present:  # a *ForSequenceClassification: no output head
    expected = [n for n in expected if n != naming.lm_head]
  missing = [n for n in expected if n not in present]
  if missing:
    raise MappingError(
      f'{len(missing)} tensors missing from the {arch} checkpoint: '
      f'{_listing(missing)}. Is it complete, and is the architecture right?'
    )
  allowed = set(expected) | set(_zero_bias_names(naming, cfg))
  if cfg.score_head:  # a reward model reads a *ForSequenceClassification's head
    allowed.add(SCORE)
    if SCORE in present and tuple(source.shape(SCORE)) != (1, cfg.d_model):
      raise MappingError(
        f'{SCORE} is {tuple(source.shape(SCORE))}, a reward model needs (1, {cfg.d_model}): one '
        'label over the hidden state.'
      )
  if cfg.tie_embeddings:
    allowed.add(naming.lm_head)  # some exporters write the tied head too; it is the embedding.
  unexpected = sorted(n for n in present - allowed if not re.fullmatch(naming.ignored, n))
  if unexpected:
    raise MappingError(
      f"the checkpoint has tensors dlmjax's {arch} mapping does not know: "
      f'{_listing(unexpected)}; the model has parts ours lacks (or more layers '
      'than its config says).'
    )
  rows = source.shape(naming.embed)[0]
  if rows < vocab_size:
    raise MappingError(
      f'{naming.embed} has {rows} rows, fewer than the {vocab_size} tokens of '
      "the config's vocabulary."
    )
  want = {naming.embed: (rows, cfg.d_model), naming.final_norm: (cfg.d_model,)}
  if naming.lm_head in expected:
    want[naming.lm_head] = (rows, cfg.d_model)
  for i in range(cfg.num_layers):
    for slot in _source_slots(naming, cfg, i):
      want.update({name: shape for name, shape, _ in _layer_tensors(naming, cfg, i, slot)})
  for name, shape in want.items():
    if source.shape(name) != shape:
      raise MappingError(
        f'{name} has shape {source.shape(name)}, expected {shape} from the '
        'model config (num_heads, head_dim, ffn_dim, ...).'
      )


def _vocab_rows(tensor_VD, padded: int) -> np.ndarray:
  """Rows [0, padded): rows past the padded size are dropped (they lie beyond the tokenizer,
  which check_source guaranteed fits), missing ones are zero."""
  out = np.zeros((padded, tensor_VD.shape[1]), np.float32)
  rows = min(padded, tensor_VD.shape[0])
  out[:rows] = tensor_VD[:rows]
  return out


def import_params(
  source,
  arch: str,
  cfg: ModelConfig,
  *,
  vocab_size: int,
  missing_qk_norm: str = 'error',
  place=lambda array: array,
) -> dict:
  """Our float32 param dict from a tensor source (keys(), shape(name), get(name)).

  Each finished array goes through `place` (e.g. jax.device_put) before the next is built, so the
  host holds one stacked array at a time, not the model (numpy arrays when `place` is identity).

  Vocabulary: the checkpoint's embedding rows V_hf may differ from our padded vocab V (cfg):
  rows [0, min(V_hf, V)) are copied, rows [V_hf, V) are zero (their logits are 0; they are
  never targets), rows past V are dropped; the tokenizer's `vocab_size` must be <= V_hf.
  q/k/v biases fill model.qkv_bias's slots; biases the model has no slot for are accepted only
  when zero. A checkpoint without QK-norm into a qk_norm=True model: `missing_qk_norm='ones'`
  fills unit scales (another function; a start for further training only).
  """
  check_source(source, arch, cfg, vocab_size=vocab_size, missing_qk_norm=missing_qk_norm)
  naming = NAMINGS[arch]
  source = _unfused(source, naming, cfg)
  for name in _zero_bias_names(naming, cfg):
    if name in source:
      bias = np.asarray(source.get(name), np.float32)
      if np.any(bias != 0):
        raise MappingError(
          f'{name} is non-zero (max |b| = {np.abs(bias).max():.3g}); dlmjax has no slot for '
          'it (attention biases, an expert bias on the router probabilities), so this model '
          'cannot be imported exactly.'
        )
  params: dict = {}
  _set(
    params,
    _EMBED,
    place(_vocab_rows(np.asarray(source.get(naming.embed), np.float32), cfg.vocab_size)),
  )
  shapes = _layer_shapes(cfg)
  for _, _, start, end in cfg.layer_runs():  # one stack per run of layers of one kind
    for slot in layer_slots(cfg, start):
      layout = _SLOTS[slot][1]
      stacked = np.empty((end - start, *shapes[slot]), np.float32)
      for j, i in enumerate(range(start, end)):
        if slot not in naming.layer_keys:  # q_norm / k_norm with missing_qk_norm='ones'.
          stacked[j] = 1.0
          continue
        if layout == 'experts':
          for name, _, e in _layer_tensors(naming, cfg, i, slot):
            stacked[j, e] = np.asarray(source.get(name), np.float32).T
          continue
        tensor = np.asarray(source.get(naming.layer_name(i, slot)), np.float32)
        stacked[j] = _from_hf(tensor, layout, shapes[slot])
      _set(params, _path(cfg, start, slot)[0], place(stacked))
      del stacked
  _set(params, _FINAL_NORM, place(np.asarray(source.get(naming.final_norm), np.float32)))
  if cfg.score_head and SCORE in source:  # a reward model's head [1, D] as ours [D, 1]
    params['score'] = place(np.ascontiguousarray(np.asarray(source.get(SCORE), np.float32).T))
  if not cfg.tie_embeddings and not cfg.score_head:  # a reward model: the backbone alone
    head_VD = _vocab_rows(np.asarray(source.get(naming.lm_head), np.float32), cfg.vocab_size)
    _set(params, _LM_HEAD, place(np.ascontiguousarray(head_VD.T)))
  return params
