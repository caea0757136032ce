"""MegaDLMs' DiffLM: Qwen3's modules and names under its own class (no model_type), with
`mask_token_id` and `attn_mask_type` in config.json. Import only: it exports as Qwen3, which
DiffLM tooling reads (the export keeps DiffLM's fields)."""

from dlmjax.checkpoint.families import base


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return any('difflm' in n for n in names)  # MegaDLMs' HF class; its config has no model_type.


FAMILY = base.Family(
  name='difflm',
  detect=_detect,
  read=lambda hf: base.transformers_dims(hf, 'difflm', qk_norm=True, qkv_bias=False),
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.QWEN3_KEYS),
  exports_to='qwen3',
)
