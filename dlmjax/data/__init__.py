"""Data: Megatron indexed datasets, tokenizers, the built-in corpus and the grain input pipeline."""
