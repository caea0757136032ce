"""SDAR / TraDo (JetAstra/SDAR training/model/SDAR-*-Chat: configuration_sdar.py,
modeling_sdar.py): Qwen3 exactly (Qwen3's tensor names, RMSNorm on q and k per head before
rotate-half RoPE, SwiGLU, no biases) trained and decoded with block-causal attention: a query in
block a sees the keys of blocks <= a, bidirectionally inside its own (modeling_sdar.py's
block_diff_mask on the clean stream; generate.py's inference mask). Logits score their own
position (no shift). Its remote code is not here: verify checks it on torch_reference.Reference."""

from dlmjax.checkpoint.families import base

DEFAULT_BLOCK_SIZE = 4  # SDAR README: the released models' default; b8..b64 variants set it.
# The Hub's SDAR-*-Chat config.json (JetLM/SDAR-4B-Chat) carries no mask_token_id: SDAR's
# generate.py reads it from the tokenizer's mask_token <|MASK|>, id 151669 (tokenizer_config.json),
# the id its README passes to JetEngine. An import without the field takes it.
MASK_TOKEN_ID = 151669
# SDAR's code (configuration_sdar.py, modeling_sdar.py and the fused loss file it imports) is not
# ours to ship: the export's auto_map names it in the Hub repository it comes from, under the class
# names SDAR-*-Chat's config.json gives (the dense sizes ship the same files).
CODE_REPO = 'JetLM/SDAR-4B-Chat'
# The fields SDAR-*-Chat's config.json carries for SDAR's training code (modeling_sdar.py reads
# fuse_cross_entropy; the rest configure its trainer), with the released values.
_TRAINING_FIELDS = dict(
  attn_implementation='flex_attention',
  fuse_cross_entropy=True,
  micro_forward=False,
  use_deepep=False,
  ep_size=1,
  skip_checkpoint=False,
  debug=False,
)


def _detect(model_type: str, names: list, hf: dict) -> bool:
  if not (model_type.startswith('sdar') or base.names_match(names, 'sdar')):
    return False
  if 'moe' in model_type or any('moe' in n for n in names) or hf.get('num_experts'):
    raise base.HFConfigError(
      f'SDAR mixture-of-experts (model_type={model_type!r}, e.g. SDAR-30B-A3B) is not supported: '
      "dlmjax's MLP is dense; the dense SDAR-1.7B/4B/8B and TraDo-4B/8B import."
    )
  return True


def finish(config, hf: dict) -> None:
  """The attention an SDAR checkpoint computes: block-causal over its config's block_size; the
  mask id of its tokenizer, and EOS as padding (generation_config.json), where config.json has
  none."""
  config.model.update(
    attention_mask='block_causal',
    block_size=int(hf.get('block_size') or DEFAULT_BLOCK_SIZE),
  )
  if not isinstance(hf.get('mask_token_id'), int) and MASK_TOKEN_ID < config.model.vocab_size:
    config.model.mask_token_id = MASK_TOKEN_ID
  if not isinstance(hf.get('pad_token_id'), int):
    config.model.pad_token_id = config.model.eos_token_id


def options_cannot_hold(m) -> str | None:
  """Why SDAR's layout cannot represent a model (config.model or ModelConfig), or None: SDAR is
  Qwen3's block (QK-norm, no biases) predicting each token at its own position, decoded with
  block-causal attention over config.json's block_size (modeling_sdar.py, generate.py)."""
  if not m.qk_norm:
    return 'the sdar layout has QK-norm (SDARAttention q_norm / k_norm), the model has none'
  if m.qkv_bias:
    return 'the sdar layout has no q/k/v-only biases (attention_bias adds an o_proj bias too)'
  if m.shift_logits:
    return 'the sdar layout predicts each token at its own position (no shift)'
  if m.attention_mask != 'block_causal':
    return (
      f'the sdar layout attends block-causally (SDAR decodes block by block), the model is '
      f'{m.attention_mask}'
    )
  return None


def cannot_hold(m) -> str | None:
  # SDAR-30B-A3B's MoE blocks are refused at import.
  return base.dense_cannot_hold(m, 'sdar') or options_cannot_hold(m)


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """SDAR's config.json (SDARConfig's fields, as JetAstra/SDAR's SDAR-*-Chat ship them, which
  JetEngine reads too) for a model options_cannot_hold accepts; refuses any other with the
  reason. `block_size` and `mask_token_id` are the model's, as SDAR's training code reads them."""
  m = config.model
  why = options_cannot_hold(m)
  if why is not None:
    raise base.HFConfigError(f'cannot export as SDAR: {why}.')
  hf = base.qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['SDARForCausalLM'],
    auto_map=base.hub_auto_map(
      CODE_REPO,
      AutoConfig='configuration_sdar.SDARConfig',
      AutoModel='modeling_sdar.SDARModel',
      AutoModelForCausalLM='modeling_sdar.SDARForCausalLM',
    ),
    model_type='sdar',
    head_dim=m.head_dim,
    attention_bias=False,
    rope_scaling=base.rope_fields(m.rope_scaling) if m.rope_scaling else None,
    block_size=m.block_size,
    bos_token_id=m.eos_token_id,  # SDAR-*-Chat: BOS = EOS = <|endoftext|>.
    **_TRAINING_FIELDS,
  )
  # SDAR's config.json has no pad_token_id (it pads with EOS, generation_config.json), and
  # modeling_sdar.py makes config.pad_token_id the embedding's padding_idx, whose row then gets
  # no gradient: the field is written only for a model that pads with another token.
  if m.pad_token_id == m.eos_token_id:
    del hf['pad_token_id']
  return hf


FAMILY = base.Family(
  name='sdar',
  detect=_detect,
  read=lambda hf: base.transformers_dims(hf, 'sdar', qk_norm=True, qkv_bias=False),
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.QWEN3_KEYS),
  write=write,
  cannot_hold=cannot_hold,
  finish=finish,
  parity='reference',
  reference_mask='block_causal',
)
