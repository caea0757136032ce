"""The values the model.* and train.lora.* keys choose among, apart from the modules that
dispatch on them (attention, layers, transformer, moe, quantize, lora): jax-free, so a config is
checked before jax loads. Those modules read their names from here; the function tables keyed by
them (attention.BACKENDS, transformer.REMAT_POLICIES) are tied to them by tests/config_test.py."""

ATTENTION_MASKS = ('bidirectional', 'causal', 'block_causal')  # model.attention_mask
ATTENTION_BACKENDS = ('xla', 'cudnn', 'pallas', 'auto')  # model.attention_backend
COMPUTE_DTYPES = ('float32', 'bfloat16')  # model.dtype: the activations' dtype (params: float32)
MATMUL_DTYPES = ('compute', 'fp8')  # model.matmul_dtype: the projections' operand precision.
NORM_BACKENDS = ('xla', 'pallas', 'auto')  # model.norm_backend (RMSNorm)
# model.remat: what the scanned layers keep for the backward
REMAT_POLICIES = ('none', 'minimal', 'save_dots', 'save_dots_attention', 'save_activations', 'full')
MOE_ROUTERS = ('softmax_topk', 'softmax_topk_raw', 'sigmoid_bias')  # model.moe.router
MOE_EXCHANGES = ('gather', 'all_to_all')  # model.moe.exchange: how tokens reach sharded experts
WEIGHT_QUANT = ('none', 'int8', 'nf4', 'int4')  # ModelConfig.weight_quant (quantize.py)
# train.lora.base_dtype: the frozen base's storage.
LORA_BASE_DTYPES = ('bfloat16', 'float32', *(kind for kind in WEIGHT_QUANT if kind != 'none'))
