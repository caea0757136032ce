"""Hugging Face config.json <-> dlmjax config: which family a checkpoint is, and its dims.

Each family (checkpoint/families/: Qwen3, MegaDLMs DiffLM, Qwen2, Llama, LLaDA, SDAR, Dream,
Qwen3-MoE, LLaDA-MoE) reads its config.json into the model options of its family (model.qk_norm,
model.qkv_bias, model.rope_scaling, model.shift_logits, SDAR's block-causal attention,
model.moe.num_experts, model.moe.router, ...) and writes it back; anything else, or a part we cannot
compute (sliding windows, a RoPE scaling type without a formula here, ...), is refused by name. This
module is the lookup: detect the family, read or check a config with it, and pick the family an
export writes by default (export_family: Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama with
neither, Dream for a shifted model; moe_family for an MoE one), plus MegaDLMs DiffLM's
`mask_token_id` and `attn_mask_type` in every transformers export.
"""

from __future__ import annotations

import json
import os

from dlmjax import config as config_lib
from dlmjax.checkpoint import families

DLMJAX_CONFIG_FILE = 'dlmjax_config.json'  # the full run config, beside config.json in exports.
MODELING_FILE = families.base.MODELING_FILE
ARCHITECTURES = tuple(families.FAMILIES)
_MASK_KINDS = ('bidirectional', 'causal', 'block_causal')
# Exported families: (model.qk_norm, model.qkv_bias) -> the transformers class computing it.
EXPORT_FAMILIES = {(True, False): 'qwen3', (False, True): 'qwen2', (False, False): 'llama'}
HFConfigError = families.HFConfigError


def read(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise HFConfigError(f'{path} is missing: {hf_dir} is not a Hugging Face model directory.')
  with open(path) as f:
    return json.load(f)


def detect_architecture(hf: dict) -> str:
  """One of ARCHITECTURES, from `architectures` and `model_type` (families.detect)."""
  return families.detect(hf).name


def embedding_rows(hf: dict, arch: str) -> int:
  """Rows of the checkpoint's embedding (LLaDA may pad it past vocab_size: `embedding_size`)."""
  return families.get(arch).embedding_rows(hf)


def export_family(*, qk_norm: bool, qkv_bias: bool, shift_logits: bool = False) -> str:
  """The family whose layout and forward are exactly the model with these options (a shifted
  model: Dream's, the only one that reads token i from position i-1)."""
  if shift_logits:
    if qk_norm or not qkv_bias:
      raise HFConfigError(
        'model.shift_logits=True exports only as Dream (q/k/v biases, no QK-norm); this model has '
        f'qk_norm={bool(qk_norm)}, qkv_bias={bool(qkv_bias)}, which no family with the shift holds.'
      )
    return 'dream'
  family = EXPORT_FAMILIES.get((bool(qk_norm), bool(qkv_bias)))
  if family is None:
    raise HFConfigError(
      'model.qk_norm=True with model.qkv_bias=True has no Hugging Face family to export to '
      '(Qwen3 has QK-norm and no q/k/v-only biases, Qwen2 the biases without QK-norm).'
    )
  return family


def moe_family(*, router: str, qk_norm: bool, shared_experts: int) -> str:
  """The MoE family an MoE model exports to by default: LLaDA2's for a sigmoid_bias router,
  Qwen3-MoE's when it has QK-norm and no shared experts, else LLaDA-MoE's (hf_layouts says
  whether that one can hold it)."""
  if router == 'sigmoid_bias':
    return 'llada2_moe'
  return 'qwen3_moe' if qk_norm and not shared_experts else 'llada_moe'


def config_from_hf(hf: dict, base=None):
  """A dlmjax config for a Hugging Face model: `base` (or the defaults) with the model's dims.

  Special ids (mask, eos, pad) are taken when the HF config has them (or its family means them).
  A plain Qwen3/Llama is a causal LM; it imports with `base`'s attention mask (bidirectional by
  default), the usual start for adapting an AR model into a diffusion LM. A DiffLM keeps its
  `attn_mask_type`.
  """
  family = families.detect(hf)
  config = config_lib.defaults() if base is None else base
  config_lib.set_model_fields(config.model, family.read(hf))
  ids = family.special_ids(hf)
  for key in families.base.SPECIAL_IDS:
    value = ids.get(key)
    if isinstance(value, int) and 0 <= value < config.model.vocab_size:
      config.model[key] = value
  family.finish(config, hf)
  kind = hf.get('attn_mask_type')
  if kind is not None:
    if kind not in _MASK_KINDS:
      raise HFConfigError(f'attn_mask_type={kind!r} is not one of {_MASK_KINDS}.')
    config.model.attention_mask = kind
    if kind == 'block_causal':
      config.model.block_size = int(hf['block_size'])
  return config


def is_sequence_classification(hf: dict) -> bool:
  """A transformers *ForSequenceClassification checkpoint (`score.weight`, no output head)."""
  return any(str(a).endswith('ForSequenceClassification') for a in hf.get('architectures') or [])


def as_reward_model(hf: dict, config, hf_dir: str, *, derived: bool) -> None:
  """A *ForSequenceClassification import as dlmjax's reward model (stage reward), refused in one
  line where it cannot compute the same scores. Transformers pools at the last token that is not
  pad_token_id; dlmjax's reward rows are EOS-padded and pooled at the last token that is not EOS
  (rl/reward_model.py), so pad_token_id must be EOS. A derived config (no --config) takes the
  mask transformers' class attends with: config.json's attn_mask_type, else is_causal (causal
  when absent, as transformers reads it)."""
  arch = (hf.get('architectures') or ['?'])[0]
  labels = hf.get('num_labels') or len(hf.get('id2label') or {}) or 2  # transformers' default
  if labels != 1:
    raise HFConfigError(
      f'{hf_dir} is a {arch} with {labels} labels; a reward model has one score: use a '
      'checkpoint trained with num_labels=1.'
    )
  pad, eos = hf.get('pad_token_id'), config.model.eos_token_id
  if pad != eos:
    raise HFConfigError(
      f'{hf_dir} pools its score at the last token that is not pad_token_id={pad}, dlmjax at the '
      f'last that is not EOS ({eos}), so the scores would differ; use a reward model padded with '
      'EOS (pad_token_id = eos_token_id, as `convert to-hf` of a reward run writes).'
    )
  if not derived:
    if not config_lib.stage_traits(config).score_head:
      raise HFConfigError(
        f'{hf_dir} is a reward model ({arch}: a score head, no token head): a '
        f'stage={config.stage} run cannot start from it; set --config.init_from to a language '
        'model.'
      )
    return
  config.stage = 'reward'
  if 'attn_mask_type' not in hf:
    config.model.attention_mask = 'bidirectional' if hf.get('is_causal') is False else 'causal'


def check_matches(hf: dict, config, *, missing_qk_norm: str = 'error') -> None:
  """Raises HFConfigError listing every model dimension where `config` and the checkpoint differ
  (missing_qk_norm='ones' lets a QK-norm config take a checkpoint without QK-norm)."""
  family = families.detect(hf)
  dims = family.read(hf)
  dims.pop('seq_len', None)  # a training choice, not a property of the weights.
  if missing_qk_norm == 'ones' and not dims['qk_norm']:
    dims.pop('qk_norm')
  dims.pop('vocab_size')  # checked against the embedding rows below.
  # Compared as parsed values: 'factor=8' and 'factor=8.0' are one scaling.
  ours = {k: config_lib.model_field(config.model, k) for k in dims}
  ours['rope_scaling'] = config_lib.parse_rope_scaling(config.model.rope_scaling)
  dims['rope_scaling'] = config_lib.parse_rope_scaling(dims['rope_scaling'])
  if 'dense_layers' in dims:  # compared as indices: '0, 2' and '2,0' are one set
    ours['dense_layers'] = ','.join(map(str, config_lib.dense_layers(config.model)))
  differing = [
    f'model.{config_lib.MODEL_FIELD_KEYS.get(k, k)}: checkpoint {v!r}, config {ours[k]!r}'
    for k, v in dims.items()
    if ours[k] != v
  ]
  rows = family.embedding_rows(hf)
  if config.model.vocab_size > rows:
    differing.append(
      f'model.vocab_size: the checkpoint embeds {rows} rows, '
      f"fewer than the config's {config.model.vocab_size} tokens"
    )
  if differing:
    raise HFConfigError(
      'the config does not describe this checkpoint ('
      + '; '.join(differing)
      + "). Fix the config, or convert without --config to take the checkpoint's."
    )


def to_hf(config, *, vocab_rows: int, dtype: str, family: str | None = None) -> dict:
  """config.json of `family` (default: moe_family for an MoE model, else export_family) for a
  dlmjax config, written by the family's module."""
  m = config.model
  if not family and m.moe.num_experts:
    family = moe_family(router=m.moe.router, qk_norm=m.qk_norm, shared_experts=m.moe.shared_experts)
  family = family or export_family(
    qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, shift_logits=m.shift_logits
  )
  return families.get(family).write(config, vocab_rows=vocab_rows, dtype=dtype)
