"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM, configuration_qwen3_moe.py,
modeling_qwen3_moe.py): Qwen3's attention; softmax over the experts in float32, the top
num_experts_per_tok, renormalised when norm_topk_prob; no shared expert. Layers listed in
mlp_only_layers, or off the decoder_sparse_step grid ((i + 1) % step != 0), are dense
Qwen3MoeMLPs of intermediate_size: model.moe.dense_layers, whose MLP is ffn_dim wide. verify runs
transformers' own class (config.json's is_causal is the mask)."""

from dlmjax import config as config_lib
from dlmjax.checkpoint.families import base
from dlmjax.checkpoint.families import qwen3


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'qwen3_moe' or base.names_match(names, 'qwen3moe')


def read(hf: dict) -> dict:
  experts = hf.get('num_experts', hf.get('num_local_experts'))
  if not experts:
    raise base.HFConfigError(
      'qwen3_moe config with num_experts=0 is a dense model; save it as Qwen3.'
    )
  layers = int(hf['num_hidden_layers'])
  try:
    dense = config_lib.dense_layer_indices(
      layers,
      sparse_step=int(1 if hf.get('decoder_sparse_step') is None else hf['decoder_sparse_step']),
      mlp_only=[int(i) for i in hf.get('mlp_only_layers') or []],
    )
  except config_lib.ConfigError as e:
    raise base.HFConfigError(f'Qwen3-MoE config: {e}') from None
  if dense and len(dense.split(',')) == layers:
    raise base.HFConfigError(
      'this qwen3_moe config makes every layer dense (decoder_sparse_step / mlp_only_layers); '
      'save it as Qwen3.'
    )
  return dict(
    qwen3.read(hf),
    dense_layers=dense,
    num_experts=int(experts),
    experts_per_token=int(hf.get('num_experts_per_tok', 8)),
    moe_ffn_dim=int(hf['moe_intermediate_size']),
    shared_experts=0,
    router='softmax_topk' if hf.get('norm_topk_prob', False) else 'softmax_topk_raw',
  )


def cannot_hold(m) -> str | None:
  """Qwen3's attention (QK-norm), no shared expert, and the masks transformers' own classes
  compute from is_causal (bidirectional, causal)."""
  why = base.moe_cannot_hold(m, 'qwen3_moe')
  if why is None and not m.qk_norm:
    why = 'the qwen3_moe layout has QK-norm weights'
  if why is None and m.shared_experts:
    why = 'the qwen3_moe layout has no shared experts'
  if why is None and m.attention_mask == 'block_causal':
    why = 'the qwen3_moe layout attends bidirectionally or causally, the model is block_causal'
  return why


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """transformers' Qwen3MoeConfig config.json (as Qwen/Qwen3-30B-A3B ships it):
  model.moe.dense_layers as mlp_only_layers (with decoder_sparse_step 1 every layer not listed is
  sparse), the router's renormalisation as norm_topk_prob, the attention as `is_causal`."""
  m = config.model
  hf = base.qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['Qwen3MoeForCausalLM'],
    model_type='qwen3_moe',
    head_dim=m.head_dim,
    rope_parameters=dict(base.rope_fields(m.rope_scaling), rope_theta=m.rope_theta),
    attention_bias=False,
    is_causal=m.attention_mask == 'causal',
    dtype=hf.pop('torch_dtype'),  # transformers >= 4.56 writes and reads `dtype` only
    attn_mask_type=m.attention_mask,
    decoder_sparse_step=1,
    mlp_only_layers=list(config_lib.dense_layers(m)),
    moe_intermediate_size=m.moe.ffn_dim or m.ffn_dim,
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    norm_topk_prob=m.moe.router == 'softmax_topk',
    output_router_logits=False,
    router_aux_loss_coef=config.model.moe.balance_loss,
  )
  if m.rope_scaling:
    hf['rope_scaling'] = base.rope_fields(m.rope_scaling)
  return hf


FAMILY = base.Family(
  name='qwen3_moe',
  detect=_detect,
  read=read,
  # save_pretrained writes the published per-expert names; the fused in-memory form
  # (Qwen3MoeExperts) is read too. Its dense layers are Qwen3MoeMLPs: mlp.{gate,up,down}_proj.
  names=base.Naming(
    **base.LLAMA_LIKE,
    layer_keys=dict(base.MOE_KEYS, **{k: base.QWEN3_KEYS[k] for k in ('gate', 'up', 'down')}),
    fused=(
      ('mlp.experts.gate_up_proj', (('expert_gate', 0), ('expert_up', 1))),
      ('mlp.experts.down_proj', (('expert_down', None),)),
    ),
  ),
  write=write,
  cannot_hold=cannot_hold,
  refines='qwen3',
  in_transformers=True,
  source_parity=False,
)
