"""Dream (Dream-org/Dream-v0-*-7B, Dream-Coder, DiffuCoder: model_type 'Dream', DreamModel;
configuration_dream.py, modeling_dream.py, generation_utils.py): Qwen2's block (q/k/v biases, no
o bias, no QK-norm, rotate-half RoPE), head size hidden_size / num_attention_heads (DreamAttention
ignores any head_dim), attention hard-coded bidirectional, and the prediction for token i read
from position i-1 (model.shift_logits). DiffuCoder ships Dream's classes, so it is this family.
transformers has no Dream class: verify checks it on torch_reference.Reference."""

from dlmjax.checkpoint.families import base
from dlmjax.checkpoint.families import qwen2

# DreamConfig's defaults for the fields the import reads (configuration_dream.py), so an absent
# key means what Dream means; the special ids are Dream's <|mask|> and <|endoftext|>.
DEFAULTS = dict(
  rope_theta=10000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  mask_token_id=151666,
  pad_token_id=151643,
)
# Dream-v0 was trained on 2048-token sequences (DreamLM/Dream README); its config's
# max_position_embeddings (131072) is Qwen2.5's, so an import's canvas is capped at this.
TRAINED_LENGTH = 2048
# Dream's code is not ours to ship: the export's auto_map names it in the Hub repository it comes
# from, under the class names Dream's own config.json gives.
CODE_REPO = 'Dream-org/Dream-v0-Base-7B'


def _detect(model_type: str, names: list, hf: dict) -> bool:
  return model_type == 'dream' or base.names_match(names, 'dream')


def read(hf: dict) -> dict:
  hf = dict(DEFAULTS, **{k: v for k, v in hf.items() if v is not None})
  hf.pop('head_dim', None)
  dims = qwen2.read(hf)
  dims.update(
    shift_logits=True,
    attention_mask='bidirectional',
    seq_len=min(dims.get('seq_len', TRAINED_LENGTH), TRAINED_LENGTH),
  )
  return dims


def special_ids(hf: dict) -> dict:
  """mask / eos / pad ids of a Dream config, DreamConfig's defaults where it has none."""
  return {k: hf.get(k, DEFAULTS.get(k)) for k in base.SPECIAL_IDS}


def options_cannot_hold(m) -> str | None:
  """Why Dream's block cannot represent a model's attention options, or None."""
  if m.qk_norm:
    return 'the dream layout has no QK-norm'
  if not m.qkv_bias:
    return 'the dream layout has q/k/v biases (DreamAttention: bias=True), the model has none'
  if not m.shift_logits:
    return (
      'the dream layout reads token i from position i-1 (model.shift_logits=True), the model '
      'predicts each token at its own position'
    )
  if m.num_heads * m.head_dim != m.d_model:
    return (
      f'the dream layout needs num_heads * head_dim == d_model '
      f'({m.num_heads} * {m.head_dim} != {m.d_model})'
    )
  if m.attention_mask != 'bidirectional':
    return f'the dream layout attends bidirectionally, the model is {m.attention_mask}'
  return None


def cannot_hold(m) -> str | None:
  why = base.dense_cannot_hold(m, 'dream')
  if why is None and m.rope_scaling:
    why = f'the dream layout has no RoPE scaling (the model has {m.rope_scaling!r})'
  return why or options_cannot_hold(m)


def write(config, *, vocab_rows: int, dtype: str) -> dict:
  """Dream's config.json (DreamConfig's fields, as Dream-org/Dream-v0-*-7B ship them) for a
  model options_cannot_hold accepts; refuses any other with the reason."""
  m = config.model
  why = options_cannot_hold(m)
  if why is not None:
    raise base.HFConfigError(f'cannot export as Dream: {why}.')
  hf = base.qwen_fields(m, vocab_rows=vocab_rows, dtype=dtype)
  hf.update(
    architectures=['DreamModel'],
    auto_map=base.hub_auto_map(
      CODE_REPO,
      AutoConfig='configuration_dream.DreamConfig',
      AutoModel='modeling_dream.DreamModel',
    ),
    model_type='Dream',
    rope_scaling=None,
  )
  return hf


FAMILY = base.Family(
  name='dream',
  detect=_detect,
  read=read,
  # DreamModel (model = DreamBaseModel): Qwen2's names and biases.
  names=base.Naming(**base.LLAMA_LIKE, layer_keys=base.QWEN2_KEYS),
  write=write,
  cannot_hold=cannot_hold,
  special_ids=special_ids,
  parity='reference',
  reference_shift=True,
)
