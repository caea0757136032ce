"""transformers classes for dlmjax exports: Qwen3, Qwen2 and Llama attending with the export's mask.

Shipped by dlmjax beside the weights of every Qwen3 / Qwen2 / Llama export; config.json's auto_map
names the class, so `AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)`
loads it. It is the family's own transformers class; only the attention mask differs, taken from
config.json's `attn_mask_type` (what the dlmjax model was trained with):
  bidirectional  every token sees every token (a masked diffusion LM);
  causal         token i sees tokens <= i (an autoregressive LM);
  block_causal   token i sees every token of its block and of earlier blocks (`block_size`).
The first two are transformers' own masks chosen by config.is_causal (masking_utils,
create_causal_mask), so every attention implementation (sdpa, eager, flash) and the padding mask
work as usual; block_causal runs the attention function registered here (PyTorch SDPA with the
block mask, intersected with the padding mask). Depends only on torch and transformers' public
names (AttentionInterface, the family classes), so it reads the same in transformers 4.5x-5.x.
"""

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MASK_KINDS = ('bidirectional', 'causal', 'block_causal')
BLOCK_CAUSAL_ATTENTION = 'dlmjax_block_causal_sdpa'


def block_causal_visibility(q_len, k_len, block_size, device=None):
  """Boolean [q_len, k_len]: query position i (the last q_len of k_len) sees key j when j's block
  is not after i's."""
  q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
  k = torch.arange(k_len, device=device)[None, :]
  return (q // block_size) >= (k // block_size)


def block_causal_sdpa(
  module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
  """An attention function (transformers' AttentionInterface): SDPA over [B, N, L, H] with the
  block-causal mask, and the padding mask transformers passes (boolean, or additive with 0 where
  visible). Returns ([B, L, N, H], None)."""
  del kwargs
  allowed = block_causal_visibility(
    query.shape[2], key.shape[2], module.config.block_size, query.device
  )
  if attention_mask is not None:
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    allowed = allowed & visible[..., : key.shape[2]]
  out = F.scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=allowed,
    dropout_p=dropout if module.training else 0.0,
    scale=scaling,
    enable_gqa=query.shape[1] != key.shape[1],
  )
  return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(BLOCK_CAUSAL_ATTENTION, block_causal_sdpa)


def _mask_kind(config):
  kind = getattr(config, 'attn_mask_type', 'bidirectional')
  if kind not in MASK_KINDS:
    raise ValueError(f'attn_mask_type={kind!r} in config.json is not one of {MASK_KINDS}.')
  if kind == 'block_causal' and not getattr(config, 'block_size', 0):
    raise ValueError('attn_mask_type=block_causal needs a positive block_size in config.json.')
  return kind


def attend_with_mask_kind(model):
  """Sets a freshly built family model's attention to config.attn_mask_type's mask."""
  kind = _mask_kind(model.config)
  for module in model.modules():
    if hasattr(module, 'is_causal'):  # what sdpa / flash attention read besides the mask
      module.is_causal = kind == 'causal'
  if kind == 'block_causal':
    model.set_attn_implementation(BLOCK_CAUSAL_ATTENTION)


def _prepare(config):
  config.is_causal = _mask_kind(config) == 'causal'  # transformers' masks: false: bidirectional
  return config


class DlmjaxQwen3ForCausalLM(Qwen3ForCausalLM):
  def __init__(self, config):
    super().__init__(_prepare(config))
    attend_with_mask_kind(self)


class DlmjaxQwen2ForCausalLM(Qwen2ForCausalLM):
  def __init__(self, config):
    super().__init__(_prepare(config))
    attend_with_mask_kind(self)


class DlmjaxLlamaForCausalLM(LlamaForCausalLM):
  def __init__(self, config):
    super().__init__(_prepare(config))
    attend_with_mask_kind(self)


# A block-causal export's config.json names one of these model_types, which transformers does not
# know, with auto_map naming the config and model classes here: plain from_pretrained (no
# trust_remote_code) then refuses, asking for trust_remote_code=True, instead of attending with
# another mask. transformers pairs a remote model class with its config class by config_class.
BLOCK_CAUSAL_PREFIX = 'dlmjax_block_'


class DlmjaxBlockQwen3Config(Qwen3Config):
  model_type = BLOCK_CAUSAL_PREFIX + 'qwen3'


class DlmjaxBlockQwen2Config(Qwen2Config):
  model_type = BLOCK_CAUSAL_PREFIX + 'qwen2'


class DlmjaxBlockLlamaConfig(LlamaConfig):
  model_type = BLOCK_CAUSAL_PREFIX + 'llama'


class DlmjaxBlockQwen3ForCausalLM(DlmjaxQwen3ForCausalLM):
  config_class = DlmjaxBlockQwen3Config


class DlmjaxBlockQwen2ForCausalLM(DlmjaxQwen2ForCausalLM):
  config_class = DlmjaxBlockQwen2Config


class DlmjaxBlockLlamaForCausalLM(DlmjaxLlamaForCausalLM):
  config_class = DlmjaxBlockLlamaConfig


# model_type -> class, for loaders that pick by config.json (dlmjax.checkpoint.torch_reference).
CLASSES = dict(
  qwen3=DlmjaxQwen3ForCausalLM, qwen2=DlmjaxQwen2ForCausalLM, llama=DlmjaxLlamaForCausalLM
)
CLASSES.update(
  {
    c.config_class.model_type: c
    for c in (DlmjaxBlockQwen3ForCausalLM, DlmjaxBlockQwen2ForCausalLM, DlmjaxBlockLlamaForCausalLM)
  }
)
