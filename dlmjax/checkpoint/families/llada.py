"""LLaDA (GSAI-ML/LLaDA-8B-*: configuration_llada.py, modeling_llada.py): OLMo's config fields
(d_model, n_heads, ...) and names (model.transformer.*), of which only the `llama` block maps to
ours: pre-norm RMSNorm with a gain, silu(ff_proj) * up_proj, rotate-half RoPE, bidirectional
attention, q/k/v biases when include_qkv_bias. No PyTorch forward here reads LLaDA's names:
verify checks the tensors, then the forward of an export (Qwen2's or Llama's names)."""

from dlmjax.checkpoint.families import base

# LLaDAConfig fills every field config.json leaves out from its ModelConfig defaults
# (configuration_llada.py); the ones the import reads, so an absent key means what LLaDA means.
DEFAULTS = dict(
  block_type='sequential',
  block_group_size=1,
  layer_norm_type='default',
  layer_norm_with_affine=True,
  bias_for_layer_norm=None,
  activation_type='swiglu',
  rope=False,
  alibi=False,
  input_emb_norm=False,
  scale_logits=False,
  attention_layer_norm=False,
  include_bias=False,
  include_qkv_bias=False,
  multi_query_attention=None,
  n_kv_heads=None,
  mlp_ratio=4,
  mlp_hidden_size=None,
  rope_theta=10000.0,
  rms_norm_eps=1e-5,
  weight_tying=True,
  embedding_size=50304,
  max_sequence_length=1024,
)
# LLaDA's own code is not ours to ship: an export's auto_map names it in the Hub repository it
# comes from.
CODE_REPO = 'GSAI-ML/LLaDA-8B-Instruct'


def _get(hf: dict, key: str):
  return hf.get(key, DEFAULTS[key])


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'llada' or any('llada' in n for n in names)


def read(hf: dict) -> dict:
  """LLaDA's config read as modeling_llada.py builds the model; anything but its `llama` block
  is refused by name."""
  for key, wanted in (
    ('block_type', 'llama'),
    ('block_group_size', 1),  # >1 nests the blocks under block_groups.{g}: another layout.
    ('layer_norm_type', 'rms'),
    ('layer_norm_with_affine', True),
    # LLaDALlamaBlock multiplies act(ff_proj(x)) by up_proj(x): with act=silu that is SwiGLU;
    # 'swiglu' would halve ff_proj's output first (a shape LLaDA itself cannot multiply).
    ('activation_type', 'silu'),
    ('rope', True),
    ('alibi', False),
    ('input_emb_norm', False),
    ('scale_logits', False),
    ('include_bias', False),
  ):
    if _get(hf, key) != wanted:
      raise base.HFConfigError(
        f"LLaDA config {key}={_get(hf, key)!r}: only {key}={wanted!r} maps onto dlmjax's "
        'transformer.'
      )
  if _get(hf, 'bias_for_layer_norm'):
    raise base.HFConfigError("LLaDA bias_for_layer_norm=true: dlmjax's RMSNorm has no bias.")
  if _get(hf, 'attention_layer_norm'):
    raise base.HFConfigError(
      'LLaDA attention_layer_norm=true normalises q and k over all heads at '
      'once (OLMo style); dlmjax normalises each head, so cannot represent it.'
    )
  heads = hf['n_heads']
  kv = _get(hf, 'n_kv_heads')
  if kv is None:  # configuration_llada.py: effective_n_kv_heads.
    kv = 1 if _get(hf, 'multi_query_attention') else heads
  ffn = _get(hf, 'mlp_hidden_size') or _get(hf, 'mlp_ratio') * hf['d_model']
  return dict(
    num_layers=hf['n_layers'],
    d_model=hf['d_model'],
    num_heads=heads,
    num_kv_heads=kv,
    head_dim=hf['d_model'] // heads,
    ffn_dim=ffn,
    vocab_size=hf['vocab_size'],
    rope_theta=float(_get(hf, 'rope_theta')),
    rope_scaling='',  # LLaDA's RoPE has no scaling (modeling_llada.py RotaryEmbedding).
    norm_eps=float(_get(hf, 'rms_norm_eps')),
    tie_embeddings=bool(_get(hf, 'weight_tying')),
    seq_len=_get(hf, 'max_sequence_length'),
    qk_norm=False,
    # include_qkv_bias: q/k/v_proj get biases (LLaDALlamaBlock), attn_out and the MLP do not.
    qkv_bias=bool(_get(hf, 'include_qkv_bias')),
  )


def embedding_rows(hf: dict) -> int:
  """LLaDA may pad its embedding past vocab_size: `embedding_size`."""
  return _get(hf, 'embedding_size') or hf['vocab_size']


def cannot_hold(m) -> str | None:
  """LLaDA's `llama` block: no QK-norm, heads that tile d_model (attn_out is d_model x d_model,
  head size d_model / n_heads), and bidirectional attention only (modeling_llada.py)."""
  if m.num_experts:
    return f'the llada layout has a dense MLP, the model has {m.num_experts} experts'
  if m.qk_norm:
    return 'the llada layout has no QK-norm'
  if m.num_heads * m.head_dim != m.d_model:
    return (
      f'the llada layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if m.attention_mask != 'bidirectional':
    return f'the llada layout attends bidirectionally, the model is {m.attention_mask}'
  if m.rope_scaling:
    return f'the llada layout has no RoPE scaling (the model has {m.rope_scaling!r})'
  if m.shift_logits:
    return 'the llada layout predicts each token at its own position (no shift)'
  return None


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """LLaDA's config.json (LLaDAConfig's fields, as GSAI-ML/LLaDA-8B-* ship them) for a model
  cannot_hold accepts. `vocab_size` is the model's vocabulary, `embedding_size` the rows written
  (LLaDA pads the embedding past it)."""
  m = config.model
  hf = dict(DEFAULTS)
  hf.update(
    architectures=['LLaDAModelLM'],
    auto_map=base.hub_auto_map(
      CODE_REPO,
      AutoConfig='configuration_llada.LLaDAConfig',
      AutoModelForCausalLM='modeling_llada.LLaDAModelLM',
      AutoModel='modeling_llada.LLaDAModelLM',
    ),
    model_type='llada',
    block_type='llama',
    layer_norm_type='rms',
    activation_type='silu',
    rope=True,
    rope_full_precision=True,
    bias_for_layer_norm=False,
    alibi_bias_max=8.0,
    attention_layer_norm_with_affine=True,
    include_qkv_bias=bool(m.qkv_bias),
    d_model=m.d_model,
    n_heads=m.num_heads,
    n_kv_heads=m.num_kv_heads,
    n_layers=m.num_layers,
    mlp_hidden_size=m.ffn_dim,
    mlp_ratio=max(1, m.ffn_dim // m.d_model),  # unused when mlp_hidden_size is set.
    vocab_size=m.vocab_size,
    embedding_size=vocab_rows,
    max_sequence_length=m.seq_len,
    rope_theta=m.rope_theta,
    rms_norm_eps=m.norm_eps,
    weight_tying=bool(m.tie_embeddings),
    init_std=m.init_std,
    init_device='meta',
    init_fn='mitchell',
    attention_dropout=0.0,
    residual_dropout=0.0,
    embedding_dropout=0.0,
    flash_attention=False,
    precision={'bf16': 'amp_bf16', 'fp32': 'fp32'}[dtype],
    use_cache=False,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.pad_token_id,
    mask_token_id=m.mask_token_id,
  )
  return hf


# LLaDA's OLMo-derived LLaDALlamaBlock: ff_out(silu(ff_proj(x)) * up_proj(x)): ff_proj is the
# SwiGLU gate, up_proj the up projection, ff_out the down projection; q/k/v_proj have biases when
# include_qkv_bias.
NAMES = base.Naming(
  embed='model.transformer.wte.weight',
  final_norm='model.transformer.ln_f.weight',
  lm_head='model.transformer.ff_out.weight',
  layer='model.transformer.blocks.{i}.',
  layer_keys=dict(
    input_norm='attn_norm.weight',
    post_attn_norm='ff_norm.weight',
    q='q_proj.weight',
    k='k_proj.weight',
    v='v_proj.weight',
    o='attn_out.weight',
    gate='ff_proj.weight',
    up='up_proj.weight',
    down='ff_out.weight',
    q_bias='q_proj.bias',
    k_bias='k_proj.bias',
    v_bias='v_proj.bias',
  ),
  bias_slots=('q', 'k', 'v'),
)

FAMILY = base.Family(
  name='llada',
  detect=_detect,
  read=read,
  names=NAMES,
  write=write,
  cannot_hold=cannot_hold,
  embedding_rows=embedding_rows,
  parity=None,
)
