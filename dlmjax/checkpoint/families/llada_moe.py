"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-*, dllm's configuration_lladamoe.py and
modeling_lladamoe.py, OLMoE-derived): pre-norm RMSNorm blocks, q and k RMS-normed per head
(qk_layernorm) before rotate-half RoPE, head size hidden_size / num_attention_heads, bidirectional
attention, a softmax router whose top-k weights are never renormalised (norm_topk_prob is
hard-coded off), SwiGLU experts, and an optional shared expert of shared_expert_intermediate_size
added to every token's output. The released config.json keeps the dense model's model_type
'llada' (docs: families_and_decoding.md, LLaDA-MoE); its classes LLaDAMoEModel / LLaDAMoEModelLM
tell it apart, as dllm's model_type 'lladamoe' and configuration_lladamoe.py's 'llada_moe' do.
No PyTorch forward here reads its names (verify: its tensors, then an export's forward)."""

from dlmjax.checkpoint.families import base

# LLaDAMoEConfig's defaults (dllm's configuration_lladamoe.py) for the fields the import reads, so
# an absent key means what LLaDA-MoE means.
DEFAULTS = dict(
  num_key_value_heads=16,
  hidden_act='silu',
  max_position_embeddings=8192,
  rms_norm_eps=1e-5,
  tie_word_embeddings=False,
  attention_bias=False,
  clip_qkv=None,
  dense_intermediate_size=8192,
  expert_intermediate_size=1024,
  num_experts=64,
  num_experts_per_tok=8,
  shared_expert_intermediate_size=None,
  moe_layer_freq=None,
  qk_layernorm=True,
  moe_router_score_function='softmax',
  moe_router_enable_expert_bias=False,
  rope_theta=50000.0,
  rope_scaling=None,
  partial_rotary_factor=1.0,
  eos_token_id=156892,
  pad_token_id=156892,
)
# The mask id LLaDA-MoE's model card and dInfer generate with (absent from its config.json).
MASK_TOKEN_ID = 156895
# LLaDA-MoE's code (modeling_lladamoe.py) is not ours to ship: the export's auto_map names it in
# the Hub repository it comes from.
CODE_REPO = 'inclusionAI/LLaDA-MoE-7B-A1B-Base'


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type in ('lladamoe', 'llada_moe') or base.names_match(names, 'lladamoe')


def read(hf: dict) -> dict:
  hf = dict(DEFAULTS, **{k: v for k, v in hf.items() if v is not None})
  layers = hf['num_hidden_layers']
  freq = hf['moe_layer_freq'] or [1] * layers
  expert = int(hf['expert_intermediate_size'])
  shared = hf['shared_expert_intermediate_size'] or 0
  for ok, what in (
    (hf['hidden_act'] == 'silu', f"hidden_act={hf['hidden_act']!r} (dlmjax's experts are SwiGLU)"),
    (not hf['attention_bias'], 'attention_bias=true (dlmjax has no o_proj bias)'),
    (hf['clip_qkv'] is None, f'clip_qkv={hf["clip_qkv"]} (dlmjax does not clamp q, k, v)'),
    (
      hf['moe_router_score_function'] == 'softmax',
      f'moe_router_score_function={hf["moe_router_score_function"]!r} (the router is softmax)',
    ),
    (
      float(hf['partial_rotary_factor']) == 1.0,
      f'partial_rotary_factor={hf["partial_rotary_factor"]} (RoPE rotates every dim here)',
    ),
    (
      all(f == 1 for f in freq),
      f'moe_layer_freq={freq} (dense layers: this import has no reference forward of '
      "LLaDA-MoE's dense MLP to check them against)",
    ),
    (shared % expert == 0, f'shared_expert_intermediate_size={shared}, not a multiple of {expert}'),
  ):
    if not ok:
      raise base.HFConfigError(f'LLaDA-MoE config {what} cannot be imported exactly.')
  heads = hf['num_attention_heads']
  return dict(
    num_layers=layers,
    d_model=hf['hidden_size'],
    num_heads=heads,
    num_kv_heads=hf['num_key_value_heads'],
    head_dim=hf['hidden_size'] // heads,
    ffn_dim=int(hf['dense_intermediate_size']),
    num_experts=int(hf['num_experts']),
    experts_per_token=int(hf['num_experts_per_tok']),
    moe_ffn_dim=expert,
    dense_layers='',
    shared_experts=shared // expert,
    router='softmax_topk_raw',
    vocab_size=hf['vocab_size'],
    **base.rope(hf),
    norm_eps=float(hf['rms_norm_eps']),
    tie_embeddings=bool(hf['tie_word_embeddings']),
    seq_len=hf['max_position_embeddings'],
    qk_norm=bool(hf['qk_layernorm']),
    qkv_bias=False,
  )


def special_ids(hf: dict) -> dict:
  """Its eos / pad defaults and the model card's mask id where config.json has none."""
  return {
    **{k: DEFAULTS[k] for k in ('eos_token_id', 'pad_token_id')},
    'mask_token_id': MASK_TOKEN_ID,
    **{k: v for k, v in hf.items() if v is not None},
  }


def finish(config, hf: dict) -> None:
  config.model.attention_mask = 'bidirectional'  # LLaDAMoEAttention: is_causal=False


def cannot_hold(m) -> str | None:
  """The raw top-k softmax weights, head size d_model / num_heads, bidirectional attention."""
  why = base.moe_cannot_hold(m, 'llada_moe')
  if why is None and getattr(m, 'dense_layers', ''):
    why = 'the llada_moe export writes every layer MoE, the model has dense layers'
  if why is None and m.router != 'softmax_topk_raw':
    why = (
      'the llada_moe layout never renormalises the top-k weights '
      '(model.moe.router=softmax_topk_raw)'
    )
  if why is None and m.num_heads * m.head_dim != m.d_model:
    why = (
      f'the llada_moe layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if why is None and m.attention_mask != 'bidirectional':
    why = f'the llada_moe layout attends bidirectionally, the model is {m.attention_mask}'
  return why


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """LLaDA-MoE's config.json (LLaDAMoEConfig's fields; model_type 'llada' as the release keeps
  it, architectures LLaDAMoEModelLM)."""
  m = config.model
  expert = m.moe.ffn_dim or m.ffn_dim
  return dict(
    architectures=['LLaDAMoEModelLM'],
    auto_map=base.hub_auto_map(
      CODE_REPO,
      AutoConfig='configuration_lladamoe.LLaDAMoEConfig',
      AutoModel='modeling_lladamoe.LLaDAMoEModelLM',
      AutoModelForCausalLM='modeling_lladamoe.LLaDAMoEModelLM',
    ),
    model_type='llada',
    vocab_size=vocab_rows,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    hidden_act='silu',
    max_position_embeddings=m.seq_len,
    initializer_range=m.init_std,
    rms_norm_eps=m.norm_eps,
    use_cache=False,
    tie_word_embeddings=bool(m.tie_embeddings),
    attention_dropout=0.0,
    attention_bias=False,
    clip_qkv=None,
    dense_intermediate_size=m.ffn_dim,
    expert_intermediate_size=expert,
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    shared_expert_intermediate_size=m.moe.shared_experts * expert or None,
    moe_layer_freq=[1] * m.num_layers,
    qk_layernorm=bool(m.qk_norm),
    moe_router_score_function='softmax',
    moe_router_enable_expert_bias=False,
    output_router_logits=False,
    router_aux_loss_coef=config.model.moe.balance_loss,
    norm_topk_prob=False,
    rope_theta=m.rope_theta,
    rope_scaling=None,
    partial_rotary_factor=1.0,
    torch_dtype=base.torch_dtype(dtype),
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )


FAMILY = base.Family(
  name='llada_moe',
  detect=_detect,
  read=read,
  # OLMoE's decoder layer; a shared expert, when configured, is the layer's `shared_expert` MLP;
  # `mlp.expert_bias` (moe_router_enable_expert_bias) would be added to the router's
  # probabilities, which dlmjax cannot, so it must be zero.
  names=base.Naming(
    **base.LLAMA_LIKE,
    layer_keys=dict(
      base.MOE_KEYS,
      shared_gate='shared_expert.gate_proj.weight',
      shared_up='shared_expert.up_proj.weight',
      shared_down='shared_expert.down_proj.weight',
    ),
    zero_tensors=('mlp.expert_bias',),
  ),
  write=write,
  cannot_hold=cannot_hold,
  refines='llada',
  special_ids=special_ids,
  finish=finish,
  parity=None,
)
