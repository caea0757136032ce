"""Export: our params -> Hugging Face tensors of a layout's names (hf_layouts), one at a time.

Exports use the names of the layout asked for (hf_layouts; by default the family of the model's
options, hf_config.export_family: Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama with
neither). The slots, shapes and layout transforms are hf_slots'.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_slots
from dlmjax.model.presets import ModelConfig


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


def _export_naming(cfg: ModelConfig, names: str | None) -> hf_slots.Naming:
  """The names an export writes: NAMINGS[names] (a layout's, hf_layouts), else the family the
  model's options choose."""
  return hf_slots.NAMINGS[names or export_family(cfg)]


def _layer_exports(naming: hf_slots.Naming, cfg: ModelConfig, i: int) -> list[tuple[str, tuple]]:
  """(name, slots) of layer i's exported tensors in order: one slot each, or the slots of a
  joined tensor (Naming.joined) that the layer has, under the joined name at its first slot."""
  slots = hf_slots.layer_slots(cfg, i)
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
  shapes = hf_slots.layer_shapes(cfg)
  for i in range(cfg.num_layers):
    for joined, slots in _layer_exports(naming, cfg, i):
      if len(slots) > 1:
        parts = [hf_slots.hf_shape(shapes[s], hf_slots.SLOTS[s][1]) for s in slots]
        entries.append((joined, (sum(p[0] for p in parts), *parts[0][1:])))
        continue
      entries += [
        (name, shape) for name, shape, _ in hf_slots.layer_tensors(naming, cfg, i, slots[0])
      ]
  entries.append((naming.final_norm, (cfg.d_model,)))
  if cfg.score_head:  # a reward model: *ForSequenceClassification's score, no output head
    entries.append((hf_slots.SCORE, (1, cfg.d_model)))
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
    raise hf_slots.MappingError(f'vocab_rows={vocab_rows} must be in (0, {cfg.vocab_size}].')
  naming = _export_naming(cfg, names)
  # No named intermediates: a host copy that is transposed into a new array is freed before the
  # yield, so the generator never holds two copies of one tensor.
  yield (
    naming.embed,
    np.asarray(to_host(hf_slots.get_at(params, hf_slots.EMBED)[:vocab_rows]), np.float32),
  )

  def host(slot, i):
    path, j = hf_slots.slot_path(cfg, i, slot)
    return hf_slots.to_hf(
      np.asarray(to_host(hf_slots.get_at(params, path)[j]), np.float32), hf_slots.SLOTS[slot][1]
    )

  for i in range(cfg.num_layers):
    for joined, slots in _layer_exports(naming, cfg, i):
      if len(slots) > 1:  # one tensor stacking the slots' rows (Naming.joined)
        yield joined, np.concatenate([host(s, i) for s in slots], axis=0)
        continue
      slot = slots[0]
      layout = hf_slots.SLOTS[slot][1]
      path, j = hf_slots.slot_path(cfg, i, slot)
      if layout == 'experts':  # one layer's experts on the host, one expert's tensor yielded
        experts = np.asarray(to_host(hf_slots.get_at(params, path)[j]), np.float32)
        for name, _, e in hf_slots.layer_tensors(naming, cfg, i, slot):
          yield name, np.ascontiguousarray(experts[e].T)
        del experts
        continue
      yield naming.layer_name(i, slot), np.ascontiguousarray(host(slot, i))
  yield (
    naming.final_norm,
    np.asarray(to_host(hf_slots.get_at(params, hf_slots.FINAL_NORM)), np.float32),
  )
  if cfg.score_head:
    yield hf_slots.SCORE, np.ascontiguousarray(np.asarray(to_host(params['score']), np.float32).T)
  elif not cfg.tie_embeddings:
    yield (
      naming.lm_head,
      np.ascontiguousarray(
        np.asarray(to_host(hf_slots.get_at(params, hf_slots.LM_HEAD)[:, :vocab_rows]), np.float32).T
      ),
    )
