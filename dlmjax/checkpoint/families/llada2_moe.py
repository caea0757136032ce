"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, -flash, 2.1; dFactory's models/llada2_moe/
configuration_llada2_moe.py and modeling_llada2_moe.py, SGLang's models/llada2.py): Ling-2.0's
MoE block-diffusion model, read as modeling_llada2_moe.py computes it.

- Attention: one fused `query_key_value` projection (q | k | v rows, a bias when use_qkv_bias),
  q and k RMS-normed per head (query_layernorm / key_layernorm, applied unconditionally by
  dFactory; SGLang reads use_qk_norm, default true) before rotate-half RoPE on the first
  int(head_dim x partial_rotary_factor) dims of each head (model.rope_fraction), `dense` output
  (a bias when use_bias: imported only when zero). Decoded block by block with block-causal
  attention (dFactory's generate and SGLang: block 32), which the import sets.
- MLP: the first first_k_dense_replace layers dense SwiGLU of intermediate_size
  (model.moe.dense_layers), the rest MoE: a sigmoid gate in float32, experts chosen by the top-k of
  score + expert_bias among the topk_group best of n_group groups (a group scores the sum of its
  two best), weighted by the unbiased scores renormalised and times routed_scaling_factor
  (model.moe.router=sigmoid_bias, router_groups, router_group_topk, routed_scale), plus the shared
  experts (num_shared_experts x moe_intermediate_size) for every token.
- Tensors: the Hub's per-expert `mlp.experts.{e}.*` names; dFactory's fused training form
  (`mlp.experts.gate_proj` [E, I, H], model_type llada2_moe_veomni) imports too.

Refused in one line: another score function or hidden_act, norm_topk_prob=false (dFactory's gate
renormalises regardless, SGLang does not: the two disagree), norm_head=true (dFactory ignores it,
SGLang normalises lm_head's rows at load), one expert per token (its weight is not
renormalised), sliding windows. No PyTorch forward here reads its names: verify checks its
tensors, then the forward of an export.
"""

from dlmjax import config as config_lib
from dlmjax.checkpoint.families import base

# LLaDA2MoeConfig's defaults (dFactory configuration_llada2_moe.py) for the fields the import
# reads, so an absent key means what LLaDA2 means.
DEFAULTS = dict(
  num_key_value_heads=0,
  hidden_act='silu',
  use_qkv_bias=False,
  use_bias=True,
  use_qk_norm=True,  # SGLang's default; dFactory normalises q and k always
  rms_norm_eps=1e-5,
  norm_head=False,
  tie_word_embeddings=False,
  max_position_embeddings=16384,
  rope_theta=10000.0,
  rope_scaling=None,
  use_sliding_window=False,
  num_experts=16,
  num_shared_experts=0,
  num_experts_per_tok=2,
  n_group=8,
  topk_group=4,
  routed_scaling_factor=2.5,
  first_k_dense_replace=0,
  partial_rotary_factor=0.5,
  score_function='sigmoid',
  norm_topk_prob=True,
  pad_token_id=156892,
  eos_token_id=156892,  # dFactory's generate: eos_early_stop on 156892 (config.json has none)
)
# The mask id dFactory's generate and training scripts and SGLang's DLLM_PARAMS use.
MASK_TOKEN_ID = 156895
BLOCK_SIZE = 32  # dFactory's generate block_length and SGLang's LLaDA2MoeModelLM block_size
# LLaDA2's code is not ours to ship: an export's auto_map names it in the Hub repository.
CODE_REPO = 'inclusionAI/LLaDA2.0-mini'


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type.startswith('llada2') or base.names_match(names, 'llada2')


def _refuse(what: str) -> None:
  raise base.HFConfigError(f'LLaDA2 config {what} cannot be imported exactly.')


def read(hf: dict) -> dict:
  hf = dict(DEFAULTS, **{k: v for k, v in hf.items() if v is not None})
  for ok, what in (
    (hf['hidden_act'] == 'silu', f"hidden_act={hf['hidden_act']!r} (dlmjax's MLP is SwiGLU)"),
    (
      hf['score_function'] == 'sigmoid',
      f"score_function={hf['score_function']!r} (dlmjax's LLaDA2 gate is sigmoid + expert bias)",
    ),
    (
      bool(hf['norm_topk_prob']),
      "norm_topk_prob=false (dFactory's gate renormalises the top-k weights regardless, "
      'SGLang does not)',
    ),
    (
      not hf['norm_head'],
      "norm_head=true (dFactory's forward ignores it, SGLang L2-normalises lm_head's rows)",
    ),
    (
      int(hf['num_experts_per_tok']) > 1,
      'num_experts_per_tok=1 (its gate leaves one weight unnormalised; dlmjax renormalises)',
    ),
    (not hf['use_sliding_window'], 'use_sliding_window=true (dlmjax attends to every key)'),
  ):
    if not ok:
      _refuse(what)
  layers, heads = int(hf['num_hidden_layers']), int(hf['num_attention_heads'])
  experts, groups = int(hf['num_experts']), int(hf['n_group'] or 1)
  if experts % groups:
    _refuse(f'n_group={groups} (does not divide num_experts={experts})')
  dense = config_lib.dense_layer_indices(layers, first_k_dense=int(hf['first_k_dense_replace']))
  if dense and len(dense.split(',')) == layers:
    _refuse(f'first_k_dense_replace={hf["first_k_dense_replace"]} (every layer dense)')
  expert_dim = int(hf['moe_intermediate_size'])
  return dict(
    num_layers=layers,
    d_model=int(hf['hidden_size']),
    num_heads=heads,
    num_kv_heads=int(hf['num_key_value_heads'] or heads),
    head_dim=int(hf.get('head_dim') or hf['hidden_size'] // heads),
    ffn_dim=int(hf.get('intermediate_size') or expert_dim),
    vocab_size=int(hf['vocab_size']),
    **base.rope(hf),
    rope_fraction=float(hf['partial_rotary_factor']),
    norm_eps=float(hf['rms_norm_eps']),
    tie_embeddings=bool(hf['tie_word_embeddings']),
    seq_len=int(hf['max_position_embeddings']),
    qk_norm=bool(hf['use_qk_norm']),
    qkv_bias=bool(hf['use_qkv_bias']),
    num_experts=experts,
    experts_per_token=int(hf['num_experts_per_tok']),
    moe_ffn_dim=expert_dim,
    shared_experts=int(hf['num_shared_experts'] or 0),
    dense_layers=dense,
    router='sigmoid_bias',
    router_groups=groups,
    router_group_topk=int(hf['topk_group'] or 1),
    routed_scale=float(hf['routed_scaling_factor']),
  )


def special_ids(hf: dict) -> dict:
  """Its pad / eos defaults and the mask id of its generate where config.json has none."""
  return {
    **{k: DEFAULTS[k] for k in ('eos_token_id', 'pad_token_id')},
    'mask_token_id': MASK_TOKEN_ID,
    **{k: v for k, v in hf.items() if v is not None},
  }


def finish(config, hf: dict) -> None:
  """Block-causal attention over its decoding block (LLaDA2MoeAttention is_causal=False; the
  mask comes from generate: tril over blocks of block_length, bidirectional inside one)."""
  config.model.update(
    attention_mask='block_causal', block_size=int(hf.get('block_size') or BLOCK_SIZE)
  )


def cannot_hold(m) -> str | None:
  """LLaDA2's block: a sigmoid_bias router (its expert_bias), no logit shift, experts."""
  if not m.num_experts:
    return 'the llada2_moe layout has experts, the model a dense MLP (model.moe.num_experts=0)'
  if m.router != 'sigmoid_bias':
    return f'the llada2_moe layout routes by sigmoid with an expert bias, the model by {m.router}'
  if m.experts_per_token < 2:
    return 'the llada2_moe layout renormalises its top-k weights only for k > 1'
  if m.shift_logits:
    return 'the llada2_moe layout predicts each token at its own position (no shift)'
  dense = tuple(m.dense_layers)
  if dense != tuple(range(len(dense))):
    return f'the llada2_moe layout has dense layers only first (first_k_dense_replace), not {dense}'
  return None


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """LLaDA2's config.json (LLaDA2MoeConfig's fields, as dFactory's llada2_mini ships them;
  model_type llada2_moe: the per-expert names)."""
  m = config.model
  return dict(
    architectures=['LLaDA2MoeModelLM'],
    auto_map=base.hub_auto_map(
      CODE_REPO,
      AutoConfig='configuration_llada2_moe.LLaDA2MoeConfig',
      AutoModel='modeling_llada2_moe.LLaDA2MoeModel',
      AutoModelForCausalLM='modeling_llada2_moe.LLaDA2MoeModelLM',
    ),
    model_type='llada2_moe',
    vocab_size=vocab_rows,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    intermediate_size=m.ffn_dim,
    moe_intermediate_size=m.moe.ffn_dim or m.ffn_dim,
    first_k_dense_replace=len(config_lib.dense_layers(m)),
    hidden_act='silu',
    max_position_embeddings=m.seq_len,
    initializer_range=m.init_std,
    rms_norm_eps=m.norm_eps,
    use_rmsnorm=True,
    use_qkv_bias=bool(m.qkv_bias),
    use_bias=False,
    use_qk_norm=bool(m.qk_norm),  # SGLang reads it; dFactory's code normalises always
    norm_head=False,
    tie_word_embeddings=bool(m.tie_embeddings),
    rope_theta=m.rope_theta,
    rope_scaling=base.rope_fields(m.rope_scaling) if m.rope_scaling else None,
    partial_rotary_factor=m.rope_fraction,
    rotary_dim=int(m.head_dim * m.rope_fraction),
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    num_shared_experts=m.moe.shared_experts or None,
    n_group=m.moe.router_groups,
    topk_group=m.moe.router_group_topk,
    routed_scaling_factor=m.moe.routed_scale,
    score_function='sigmoid',
    moe_router_enable_expert_bias=True,
    norm_topk_prob=True,
    router_dtype='fp32',
    output_router_logits=False,
    embedding_dropout=0.0,
    attention_dropout=0.0,
    output_dropout=0.0,
    use_sliding_window=False,
    use_cache=False,
    torch_dtype=base.torch_dtype(dtype),
    block_size=m.block_size,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )


_QKV = 'attention.query_key_value.weight'
_QKV_BIAS = 'attention.query_key_value.bias'
NAMES = base.Naming(
  embed='model.word_embeddings.weight',
  final_norm='model.norm.weight',
  lm_head='lm_head.weight',
  layer='model.layers.{i}.',
  layer_keys=dict(
    input_norm='input_layernorm.weight',
    post_attn_norm='post_attention_layernorm.weight',
    # Row blocks of the fused projection (Naming.joined): q | k | v.
    q=f'{_QKV}[q]',
    k=f'{_QKV}[k]',
    v=f'{_QKV}[v]',
    q_bias=f'{_QKV_BIAS}[q]',
    k_bias=f'{_QKV_BIAS}[k]',
    v_bias=f'{_QKV_BIAS}[v]',
    q_norm='attention.query_layernorm.weight',
    k_norm='attention.key_layernorm.weight',
    o='attention.dense.weight',
    gate='mlp.gate_proj.weight',
    up='mlp.up_proj.weight',
    down='mlp.down_proj.weight',
    router='mlp.gate.weight',
    router_bias='mlp.gate.expert_bias',
    expert_gate='mlp.experts.{e}.gate_proj.weight',
    expert_up='mlp.experts.{e}.up_proj.weight',
    expert_down='mlp.experts.{e}.down_proj.weight',
    shared_gate='mlp.shared_experts.gate_proj.weight',
    shared_up='mlp.shared_experts.up_proj.weight',
    shared_down='mlp.shared_experts.down_proj.weight',
  ),
  bias_slots=('o',),  # use_bias: attention.dense.bias, accepted when zero
  joined=((_QKV, ('q', 'k', 'v')), (_QKV_BIAS, ('q_bias', 'k_bias', 'v_bias'))),
  # dFactory's fused experts (its training form): [E, I, H] and [E, H, I], each expert [e].
  fused=(
    ('mlp.experts.gate_proj', (('expert_gate', None),)),
    ('mlp.experts.up_proj', (('expert_up', None),)),
    ('mlp.experts.down_proj', (('expert_down', None),)),
  ),
)

FAMILY = base.Family(
  name='llada2_moe',
  detect=_detect,
  read=read,
  names=NAMES,
  write=write,
  cannot_hold=cannot_hold,
  refines='llada',
  special_ids=special_ids,
  finish=finish,
  parity=None,
)
