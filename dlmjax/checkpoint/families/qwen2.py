"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM): q/k/v biases (always, Qwen2Attention), no
o_proj bias, no QK-norm. The default export of a model with q/k/v biases."""

from dlmjax.checkpoint.families import base

_write = base.transformers_write('qwen2', 'Qwen2ForCausalLM', 'DlmjaxQwen2ForCausalLM')


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'qwen2' or base.names_match(names, 'qwen2')


def read(hf: dict) -> dict:
  return base.transformers_dims(hf, 'qwen2', qk_norm=False, qkv_bias=True)


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  hf = _write(config, vocab_rows=vocab_rows, dtype=dtype)
  del hf['attention_bias']  # Qwen2Config has no such field.
  return hf


FAMILY = base.Family(
  name='qwen2',
  detect=_detect,
  read=read,
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.QWEN2_KEYS),
  write=write,
  cannot_hold=base.transformers_cannot_hold('qwen2', qk_norm=False, qkv_bias=True),
  ships_modeling=True,
  sequence_classification='Qwen2ForSequenceClassification',
)
