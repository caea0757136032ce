"""Import: Hugging Face tensors -> our params, each stacked array filled one tensor at a time.

Imports read the names of every architecture in hf_config.ARCHITECTURES into a model with the
same options (model.qk_norm, model.qkv_bias); what a checkpoint has that our model cannot
express (a non-zero bias it has no slot for, a missing QK-norm) is refused with the reason,
never silently dropped. The slots, shapes and layout transforms are hf_slots'.
"""

from __future__ import annotations

import re

import numpy as np

from dlmjax.checkpoint import hf_slots
from dlmjax.model.presets import ModelConfig

MISSING_QK_NORM = ('error', 'ones')


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


def _source_slots(naming: hf_slots.Naming, cfg: ModelConfig, i: int) -> list[str]:
  """Layer i's slots that the checkpoint holds (a QK-norm it lacks is filled with ones)."""
  return [s for s in hf_slots.layer_slots(cfg, i) if s in naming.layer_keys]


def _expected(naming: hf_slots.Naming, cfg: ModelConfig) -> list[str]:
  names = [naming.embed, naming.final_norm]
  if not cfg.tie_embeddings:
    names.append(naming.lm_head)
  names += [
    name
    for i in range(cfg.num_layers)
    for s in _source_slots(naming, cfg, i)
    for name, _, _ in hf_slots.layer_tensors(naming, cfg, i, s)
  ]
  return names


def _zero_bias_names(naming: hf_slots.Naming, cfg: ModelConfig) -> list[str]:
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

  def __init__(self, source, naming: hf_slots.Naming, cfg: ModelConfig):
    self._source, self._virtual, self._cached = source, {}, (None, None)
    present = set(source.keys())
    self._hidden = set()
    self._rows = {}  # a joined tensor's slot name -> (joined name, first row, end row)
    shapes = hf_slots.layer_shapes(cfg)
    for i in range(cfg.num_layers):
      for suffix, slots in naming.joined:
        joined = naming.layer.format(i=i) + suffix
        if joined not in present:
          continue
        self._hidden.add(joined)
        start = 0
        for slot in (s for s in slots if s in hf_slots.layer_slots(cfg, i)):
          rows = hf_slots.hf_shape(shapes[slot], hf_slots.SLOTS[slot][1])[0]
          self._rows[naming.layer_name(i, slot)] = (joined, start, start + rows)
          start += rows
        if start != source.shape(joined)[0]:
          raise hf_slots.MappingError(
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


def _unfused(source, naming: hf_slots.Naming, cfg: ModelConfig):
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
  if arch not in hf_slots.NAMINGS:
    raise hf_slots.MappingError(
      f'unknown architecture {arch!r}; known: {", ".join(hf_slots.NAMINGS)}.'
    )
  if missing_qk_norm not in MISSING_QK_NORM:
    raise hf_slots.MappingError(
      f'missing_qk_norm={missing_qk_norm!r} is not one of {MISSING_QK_NORM}.'
    )
  naming = hf_slots.NAMINGS[arch]
  if cfg.qk_norm and 'q_norm' not in naming.layer_keys and missing_qk_norm == 'error':
    raise hf_slots.MappingError(
      f'{arch} has no QK-norm, but the model has model.qk_norm=True (RMSNorm on q and k per '
      'head before RoPE), so these weights would compute a different function. Import with '
      'model.qk_norm=False (what converting without --config derives for this family), or, to '
      'use them as the start of further training of a QK-norm model, convert with '
      '--missing-qk-norm=ones (unit q/k norm scales; expect a higher loss at first).'
    )
  if cfg.qkv_bias and 'q_bias' not in naming.layer_keys:
    raise hf_slots.MappingError(
      f'{arch} checkpoints have no q/k/v biases, but the model has model.qkv_bias=True; '
      'import with model.qkv_bias=False.'
    )
  lacking = [
    s
    for s in hf_slots.model_slots(cfg)
    if s not in naming.layer_keys and s not in hf_slots.QK_NORM_SLOTS
  ]
  if lacking:
    raise hf_slots.MappingError(
      f"the {arch} layout has no place for the model's {', '.join(lacking)} weights (e.g. shared "
      'experts, model.moe.shared_experts > 0); import into a model without them.'
    )
  source = _unfused(source, naming, cfg)
  expected = _expected(naming, cfg)
  present = set(source.keys())
  if cfg.score_head and hf_slots.SCORE in present:  # a *ForSequenceClassification: no output head
    expected = [n for n in expected if n != naming.lm_head]
  missing = [n for n in expected if n not in present]
  if missing:
    raise hf_slots.MappingError(
      f'{len(missing)} tensors missing from the {arch} checkpoint: '
      f'{_listing(missing)}. Is it complete, and is the architecture right?'
    )
  allowed = set(expected) | set(_zero_bias_names(naming, cfg))
  if cfg.score_head:  # a reward model reads a *ForSequenceClassification's head
    allowed.add(hf_slots.SCORE)
    if hf_slots.SCORE in present and tuple(source.shape(hf_slots.SCORE)) != (1, cfg.d_model):
      raise hf_slots.MappingError(
        f'{hf_slots.SCORE} is {tuple(source.shape(hf_slots.SCORE))}, a reward model needs '
        f'(1, {cfg.d_model}): one label over the hidden state.'
      )
  if cfg.tie_embeddings:
    allowed.add(naming.lm_head)  # some exporters write the tied head too; it is the embedding.
  unexpected = sorted(n for n in present - allowed if not re.fullmatch(naming.ignored, n))
  if unexpected:
    raise hf_slots.MappingError(
      f"the checkpoint has tensors dlmjax's {arch} mapping does not know: "
      f'{_listing(unexpected)}; the model has parts ours lacks (or more layers '
      'than its config says).'
    )
  rows = source.shape(naming.embed)[0]
  if rows < vocab_size:
    raise hf_slots.MappingError(
      f'{naming.embed} has {rows} rows, fewer than the {vocab_size} tokens of '
      "the config's vocabulary."
    )
  want = {naming.embed: (rows, cfg.d_model), naming.final_norm: (cfg.d_model,)}
  if naming.lm_head in expected:
    want[naming.lm_head] = (rows, cfg.d_model)
  for i in range(cfg.num_layers):
    for slot in _source_slots(naming, cfg, i):
      want.update({name: shape for name, shape, _ in hf_slots.layer_tensors(naming, cfg, i, slot)})
  for name, shape in want.items():
    if source.shape(name) != shape:
      raise hf_slots.MappingError(
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
  naming = hf_slots.NAMINGS[arch]
  source = _unfused(source, naming, cfg)
  for name in _zero_bias_names(naming, cfg):
    if name in source:
      bias = np.asarray(source.get(name), np.float32)
      if np.any(bias != 0):
        raise hf_slots.MappingError(
          f'{name} is non-zero (max |b| = {np.abs(bias).max():.3g}); dlmjax has no slot for '
          'it (attention biases, an expert bias on the router probabilities), so this model '
          'cannot be imported exactly.'
        )
  params: dict = {}
  hf_slots.set_at(
    params,
    hf_slots.EMBED,
    place(_vocab_rows(np.asarray(source.get(naming.embed), np.float32), cfg.vocab_size)),
  )
  shapes = hf_slots.layer_shapes(cfg)
  for _, _, start, end in cfg.layer_runs():  # one stack per run of layers of one kind
    for slot in hf_slots.layer_slots(cfg, start):
      layout = hf_slots.SLOTS[slot][1]
      stacked = np.empty((end - start, *shapes[slot]), np.float32)
      for j, i in enumerate(range(start, end)):
        if slot not in naming.layer_keys:  # q_norm / k_norm with missing_qk_norm='ones'.
          stacked[j] = 1.0
          continue
        if layout == 'experts':
          for name, _, e in hf_slots.layer_tensors(naming, cfg, i, slot):
            stacked[j, e] = np.asarray(source.get(name), np.float32).T
          continue
        tensor = np.asarray(source.get(naming.layer_name(i, slot)), np.float32)
        stacked[j] = hf_slots.from_hf(tensor, layout, shapes[slot])
      hf_slots.set_at(params, hf_slots.slot_path(cfg, start, slot)[0], place(stacked))
      del stacked
  hf_slots.set_at(
    params, hf_slots.FINAL_NORM, place(np.asarray(source.get(naming.final_norm), np.float32))
  )
  if cfg.score_head and hf_slots.SCORE in source:  # a reward model's head [1, D] as ours [D, 1]
    params['score'] = place(
      np.ascontiguousarray(np.asarray(source.get(hf_slots.SCORE), np.float32).T)
    )
  if not cfg.tie_embeddings and not cfg.score_head:  # a reward model: the backbone alone
    head_VD = _vocab_rows(np.asarray(source.get(naming.lm_head), np.float32), cfg.vocab_size)
    hf_slots.set_at(params, hf_slots.LM_HEAD, place(np.ascontiguousarray(head_VD.T)))
  return params
