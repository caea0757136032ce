"""The one jit for every program that runs the model: train step, eval, sampler, forward.

A program compiled with plain jax.jit would lose the compiler options the model's matmuls need
(model/fp8.py: with FP8 on GPU, XLA's Triton GEMMs off), so its FP8 matmuls would silently run
in another precision.
"""

from __future__ import annotations

import jax

from dlmjax.model import fp8


def jit_program(fn, matmul_dtype: str, **jit_kwargs):
  """jax.jit(fn, **jit_kwargs) with the compiler options of `matmul_dtype` (model.matmul_dtype)."""
  return jax.jit(fn, compiler_options=fp8.compiler_options(matmul_dtype) or None, **jit_kwargs)
