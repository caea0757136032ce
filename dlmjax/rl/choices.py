"""The values the rl.* keys choose among, apart from the modules that read them (prompts,
reference): jax-free, so a config is checked before jax loads. The objectives are a registry of
their own (rl/objectives/)."""

HELD_OUT_SPLITS = ('test', 'valid')  # rl.eval_split: the test split, or unused train problems
REFERENCE_DTYPES = ('float32', 'bfloat16')  # rl.reference_dtype: bfloat16 halves its memory
