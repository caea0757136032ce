"""Llama (transformers' LlamaForCausalLM): no biases (attention_bias would add q/k/v and o_proj
ones, which dlmjax lacks: zero ones are accepted), no QK-norm, RoPE with llama3 / linear scaling.
The default export of a model with neither QK-norm nor biases."""

from dlmjax.checkpoint.families import base

_write = base.transformers_write('llama', 'LlamaForCausalLM', 'DlmjaxLlamaForCausalLM')


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'llama' or base.names_match(names, 'llama')


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  hf = _write(config, vocab_rows=vocab_rows, dtype=dtype)
  for key in ('use_sliding_window', 'sliding_window', 'max_window_layers'):
    del hf[key]
  hf['mlp_bias'] = False
  return hf


FAMILY = base.Family(
  name='llama',
  detect=_detect,
  read=lambda hf: base.transformers_dims(hf, 'llama', qk_norm=False, qkv_bias=False),
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.LLAMA_KEYS, bias_slots=('q', 'k', 'v', 'o')),
  write=write,
  cannot_hold=base.transformers_cannot_hold('llama', qk_norm=False, qkv_bias=False),
  ships_modeling=True,
  sequence_classification='LlamaForSequenceClassification',
)
