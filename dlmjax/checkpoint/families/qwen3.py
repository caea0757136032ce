"""Qwen3 (transformers' Qwen3ForCausalLM): RMSNorm on q and k per head before rotate-half RoPE,
no biases. The default export of a QK-norm model: our modeling_dlmjax.py class computes every
mask kind, transformers' own class the bidirectional and causal ones (config.json's is_causal)."""

from dlmjax.checkpoint.families import base


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'qwen3' or base.names_match(names, 'qwen3')


def read(hf: dict) -> dict:
  return base.transformers_dims(hf, 'qwen3', qk_norm=True, qkv_bias=False)


FAMILY = base.Family(
  name='qwen3',
  detect=_detect,
  read=read,
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.QWEN3_KEYS),
  write=base.transformers_write('qwen3', 'Qwen3ForCausalLM', 'DlmjaxQwen3ForCausalLM'),
  cannot_hold=base.transformers_cannot_hold('qwen3', qk_norm=True, qkv_bias=False),
  ships_modeling=True,
  sequence_classification='Qwen3ForSequenceClassification',
)
