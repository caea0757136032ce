"""Named model shapes (one table): the model.* key values of each preset, and apply_preset, which
config files call. Plain data beside the schema, so a config file loads without jax (the command
lines check a config before importing anything heavy); model/presets.py builds ModelConfig."""

from __future__ import annotations

from dlmjax.config.derived import set_model_fields
from dlmjax.config.errors import ConfigError

# SDAR's block diffusion: block-causal attention over blocks of 4 (SDAR's released models).
_SDAR_BLOCKS = dict(attention_mask='block_causal', block_size=4)

PRESETS: dict[str, dict] = {
  # A few-million-parameter model that learns visibly on a 2-core CPU in minutes.
  'tiny': dict(
    num_layers=4, d_model=256, num_heads=4, num_kv_heads=4, head_dim=64, ffn_dim=768, seq_len=128
  ),
  # MegaDLMs examples/dlm_training/dlm_pretrain_1.7b.sh (Qwen3-1.7B shape, plain MHA, untied).
  '1p7b': dict(
    num_layers=28,
    d_model=2048,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    ffn_dim=6144,
    seq_len=2048,
    vocab_size=50289,
    rope_theta=10000.0,
    norm_eps=1e-6,
    init_std=0.02,
    tie_embeddings=False,
    mask_token_id=50277,
    eos_token_id=0,
    pad_token_id=1,
  ),
  # Qwen/Qwen2.5-0.5B config.json (Qwen2ForCausalLM): q/k/v biases, no QK-norm, tied; 0.49B.
  # Qwen2.5 has no MASK token: mask_token_id is the first embedding row past the tokenizer's
  # 151,665 ids; EOS and padding are <|endoftext|> (151643), as the base model's config.
  'qwen2p5_0p5b': dict(
    num_layers=24,
    d_model=896,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    ffn_dim=4864,
    seq_len=2048,
    vocab_size=151936,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=False,
    qkv_bias=True,
    tie_embeddings=True,
    mask_token_id=151665,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
  # Qwen/Qwen2.5-7B config.json: as 0.5B but untied, vocab 152064; 7.61B.
  'qwen2p5_7b': dict(
    num_layers=28,
    d_model=3584,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    ffn_dim=18944,
    seq_len=2048,
    vocab_size=152064,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=False,
    qkv_bias=True,
    tie_embeddings=False,
    mask_token_id=151665,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
  # Qwen/Qwen3-0.6B config.json: GQA 16/8, head_dim 128 (num_heads * head_dim != d_model), QK-norm,
  # tied, theta 1e6. Qwen3 has no MASK token: mask_token_id is the first embedding row past the
  # tokenizer's 151,669 ids; EOS and padding are <|endoftext|> (151643), as the Base configs.
  'qwen3_0p6b': dict(
    num_layers=28,
    d_model=1024,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=3072,
    seq_len=2048,
    vocab_size=151936,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    qkv_bias=False,
    tie_embeddings=True,
    mask_token_id=151669,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
  # Qwen/Qwen3-1.7B config.json: not '1p7b' above (MegaDLMs' 1.7B: MHA 16/16, vocab 50289, untied,
  # theta 1e4); this is Qwen3's own: GQA 16/8, vocab 151936, tied, theta 1e6.
  'qwen3_1p7b': dict(
    num_layers=28,
    d_model=2048,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=6144,
    seq_len=2048,
    vocab_size=151936,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    qkv_bias=False,
    tie_embeddings=True,
    mask_token_id=151669,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
  # Qwen/Qwen3-8B config.json: 36 layers, GQA 32/8, untied.
  'qwen3_8b': dict(
    num_layers=36,
    d_model=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=12288,
    seq_len=2048,
    vocab_size=151936,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    qkv_bias=False,
    tie_embeddings=False,
    mask_token_id=151669,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
  # meta-llama/Meta-Llama-3-8B config.json (Llama-3, not 3.1: no rope_scaling): GQA 32/8, no
  # QK-norm or biases, untied, theta 5e5, eps 1e-5. Its 128,256 rows are all tokenizer ids: MASK is
  # <|reserved_special_token_0|> (128002), EOS and padding <|end_of_text|> (128001).
  'llama3_8b': dict(
    num_layers=32,
    d_model=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=14336,
    seq_len=2048,
    vocab_size=128256,
    rope_theta=5e5,
    norm_eps=1e-5,
    qk_norm=False,
    qkv_bias=False,
    tie_embeddings=False,
    mask_token_id=128002,
    eos_token_id=128001,
    pad_token_id=128001,
  ),
  # GSAI-ML/LLaDA-8B-Base / -Instruct config.json (LLaDALlamaBlock): MHA 32/32, mlp_hidden_size
  # 12288, no QK-norm or biases, untied, theta 5e5, eps 1e-5, vocab_size = embedding_size 126464;
  # mask <|mdm_mask|> 126336, EOS and padding 126081, trained at max_sequence_length 4096.
  'llada_8b': dict(
    num_layers=32,
    d_model=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    ffn_dim=12288,
    seq_len=4096,
    vocab_size=126464,
    rope_theta=5e5,
    norm_eps=1e-5,
    qk_norm=False,
    qkv_bias=False,
    tie_embeddings=False,
    mask_token_id=126336,
    eos_token_id=126081,
    pad_token_id=126081,
  ),
  # SDAR / TraDo (JetAstra/SDAR training/model/SDAR-{4B,8B}-Chat/config.json; TraDo-4B/8B share
  # the shapes): Qwen3 blocks (QK-norm, GQA 32/8, head_dim 128, theta 1e6, eps 1e-6), untied,
  # block-causal attention over blocks of 4 (the released default), MASK <MASK> 151669, EOS and
  # padding <|endoftext|> 151643. Counts: model.safetensors.index.json total_size / 2 (bf16).
  # SDAR-4B-Chat: 8,822,848,512 B = 4,411,424,256 params (Qwen3-4B's dims, but untied).
  'sdar_4b': dict(
    num_layers=36,
    d_model=2560,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=9728,
    seq_len=2048,
    vocab_size=151936,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    qkv_bias=False,
    tie_embeddings=False,
    **_SDAR_BLOCKS,
    mask_token_id=151669,
    eos_token_id=151643,
    pad_token_id=151643,
  ),
}

# Presets that are another's shape with the family's own options.
# Dream-org/Dream-v0-Base-7B / -Instruct-7B config.json (model_type Dream; DiffuCoder-7B is the
# same shape): Qwen2.5-7B's block (q/k/v biases, no QK-norm, untied, vocab 152064, theta 1e6,
# eps 1e-6), bidirectional, token i predicted from position i-1; <|mask|> 151666, EOS and
# padding <|endoftext|> 151643; trained at 2048 tokens (DreamLM/Dream README). Parameters:
# 28 x (3584*128*(2*28 + 2*4) + 128*(28 + 2*4) + 3*3584*18944 + 2*3584) + 2*152064*3584 + 3584
# = 7,615,616,512, the 7.62B of the model card (safetensors total) and Qwen2.5-7B's count.
PRESETS['dream_7b'] = dict(
  PRESETS['qwen2p5_7b'], shift_logits=True, attention_mask='bidirectional', mask_token_id=151666
)
# SDAR-8B-Chat: 16,381,470,720 B = 8,190,735,360 params (Qwen3-8B's shape).
PRESETS['sdar_8b'] = dict(PRESETS['qwen3_8b'], **_SDAR_BLOCKS)
# SDAR-1.7B-Chat: Qwen3-1.7B's dims (2048/28/16/8/128/6144). Its config.json is not in the
# SDAR repository; untied as SDAR's 4B and 8B configs are (SDAR-4B unties where Qwen3-4B ties):
# 2,031,739,904 params. The Hub's JetLM/SDAR-1.7B-Chat model.safetensors is one 4.06 GB bf16
# file, 2.03e9 stored values: the head is stored (a tied save would be 3.44 GB), which fits an
# untied model but not proof (Qwen3-1.7B stores its head too and ties it). Unconfirmed: if its
# config.json says tie_word_embeddings=true, set model.tie_embeddings=True (1,720,574,976).
PRESETS['sdar_1p7b'] = dict(PRESETS['qwen3_1p7b'], tie_embeddings=False, **_SDAR_BLOCKS)

# Mixture-of-experts shapes (model/moe.py; every layer MoE, no shared experts).
# A tiny MoE for CPU runs and tests: the tiny preset with 8 experts of width 192, 2 per token.
PRESETS['tiny_moe'] = dict(
  PRESETS['tiny'], num_experts=8, experts_per_token=2, moe_ffn_dim=192, router='softmax_topk'
)
# inclusionAI/LLaDA-MoE-7B-A1B-Base (docs: families_and_decoding.md, LLaDA-MoE; dllm's
# configuration_lladamoe.py): 16 layers of OLMoE-style blocks, MHA 16/16 x 128, QK-norm, theta
# 5e4, 64 experts of 1024, top-8 with the raw softmax weights (no renormalisation), untied;
# vocab 157184 (the Ling tokenizer's; unconfirmed for this config), mask 156895, EOS 156892.
# Parameters: 7,356,880,896 total and 1,719,736,320 active per token (embeddings included; the
# paper's 7B / 1.4B, and 1.08B active without the embeddings: "A1B").
PRESETS['llada_moe_7b_a1b'] = dict(
  num_layers=16,
  d_model=2048,
  num_heads=16,
  num_kv_heads=16,
  head_dim=128,
  ffn_dim=8192,
  num_experts=64,
  experts_per_token=8,
  moe_ffn_dim=1024,
  shared_experts=0,
  router='softmax_topk_raw',
  seq_len=4096,
  vocab_size=157184,
  rope_theta=50000.0,
  norm_eps=1e-5,
  qk_norm=True,
  qkv_bias=False,
  tie_embeddings=False,
  mask_token_id=156895,
  eos_token_id=156892,
  pad_token_id=156892,
)
# Qwen/Qwen3-30B-A3B config.json (Qwen3MoeForCausalLM): 48 layers, GQA 32/4 x 128, QK-norm,
# theta 1e6, 128 experts of 768, top-8 renormalised (norm_topk_prob), untied, vocab 151936; an AR
# base for adaptation (no MASK token: 151669, the first row past the tokenizer, as Qwen3).
# Parameters: 30,532,122,624 total, 3,353,032,704 active (the model card's 30.5B and 3.3B).
PRESETS['qwen3_30b_a3b'] = dict(
  num_layers=48,
  d_model=2048,
  num_heads=32,
  num_kv_heads=4,
  head_dim=128,
  ffn_dim=6144,
  num_experts=128,
  experts_per_token=8,
  moe_ffn_dim=768,
  shared_experts=0,
  router='softmax_topk',
  seq_len=2048,
  vocab_size=151936,
  rope_theta=1e6,
  norm_eps=1e-6,
  qk_norm=True,
  qkv_bias=False,
  tie_embeddings=False,
  mask_token_id=151669,
  eos_token_id=151643,
  pad_token_id=151643,
)

# LLaDA2.0 (inclusionAI/LLaDA2.X README: mini 16B, flash 100B), config.json values from dFactory
# configs/model_configs/{llada2_mini,llada2_flash}/config.json (checkpoint/families/llada2_moe.py
# reads them the same way): GQA x 128 with QK-norm, RoPE on half of each head (theta 6e5), layer
# 0 dense, 256 experts top-8 by sigmoid + expert bias in 8 groups (best 4 kept), weights x 2.5,
# one shared expert, untied, vocab 157184, mask 156895, EOS = pad 156892; decoded block-causally
# over 32-token blocks. max_position_embeddings is 16384; seq_len here is a training canvas.
_LLADA2 = dict(
  head_dim=128,
  num_kv_heads=4,
  num_experts=256,
  experts_per_token=8,
  shared_experts=1,
  router='sigmoid_bias',
  router_groups=8,
  router_group_topk=4,
  routed_scale=2.5,
  dense_layers='0',
  rope_fraction=0.5,
  seq_len=4096,
  vocab_size=157184,
  rope_theta=600000.0,
  norm_eps=1e-6,
  qk_norm=True,
  qkv_bias=False,
  tie_embeddings=False,
  attention_mask='block_causal',
  block_size=32,
  mask_token_id=156895,
  eos_token_id=156892,
  pad_token_id=156892,
)
# Parameters: 16,255,643,392 total, 1,432,973,056 active per token (embeddings included): the
# README's 16B; "A1.4B" active is the model's name, not confirmed in a source read here.
PRESETS['llada2_mini'] = dict(
  _LLADA2, num_layers=20, d_model=2048, num_heads=16, ffn_dim=5120, moe_ffn_dim=512
)
# Parameters: 102,889,705,216 total, 6,152,277,760 active: the README's 100B; "A6.1B" as above.
PRESETS['llada2_flash'] = dict(
  _LLADA2, num_layers=32, d_model=4096, num_heads=32, ffn_dim=9216, moe_ffn_dim=1024
)


def apply_preset(model_config, name: str) -> None:
  """Sets every dimension of `name` on a config.model node (configs call this, then override)."""
  if name not in PRESETS:
    raise ConfigError(f'unknown model preset {name!r}; known: {sorted(PRESETS)}.')
  set_model_fields(model_config, PRESETS[name])
