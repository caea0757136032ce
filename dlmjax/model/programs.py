"""The one jit for every program that runs the model: train step, eval, sampler, forward.

A program compiled with plain jax.jit would lose the compiler options the model's matmuls need
(model/fp8.py: with FP8 on GPU, XLA's Triton GEMMs off), so its FP8 matmuls would silently run
in another precision; a decode program would copy every layer's weights each step (below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.model import fp8

# A decode step reads each layer's weights once at a small batch: the step is bound by those
# reads. XLA's Triton GEMM fusions cannot read a weight that the layer loop slices from the
# stacked layers in place, so every step first copied all of them (7 ms of a 13 ms 8B step on an
# H200); cuBLAS GEMMs with dynamic-slice fusion read the slice where it lies (docs/benchmarks.md,
# Sampler, where a decode step's time goes). XLA's dot merger joins projections that share an
# input (q, k, v) into one GEMM over their concatenated weights, and so wrote that concatenation
# every step (1.0 ms a step at every batch size); off, each projection reads its own weight.
_DECODE_GPU_OPTIONS = {
  'xla_gpu_enable_triton_gemm': False,
  'xla_gpu_enable_dynamic_slice_fusion': True,
  'xla_gpu_dot_merger_threshold_mb': 0,
}


def compiler_options(matmul_dtype: str, *, decode: bool = False) -> dict:
  """XLA options of a program with these matmuls; decode: a sampler's loop of forwards."""
  options = dict(fp8.compiler_options(matmul_dtype))
  if decode and jax.default_backend() == 'gpu':
    options.update(_DECODE_GPU_OPTIONS)
  return options


def jit_program(fn, matmul_dtype: str, *, decode: bool = False, **jit_kwargs):
  """jax.jit(fn, **jit_kwargs) with the compiler options of `matmul_dtype` (model.matmul_dtype)
  and, for a decode program (decode=True), those that let it read weights in place."""
  options = compiler_options(matmul_dtype, decode=decode)
  return jax.jit(fn, compiler_options=options or None, **jit_kwargs)


def as_float32_params(params: dict, matmul_dtype: str) -> dict:
  """params in any float dtype (a bfloat16 reference, a LoRA base) as a program computes with
  the training step's float32 master params. With matmuls in the compute dtype the forward casts
  every float it reads to that dtype first (transformer.computed_params says where), so they
  stay as stored: an upcast would change no value, yet on the GPU it wrote a float32 copy of
  every weight before the forward (45 GiB of the 8B VRPO reference's scoring, docs/preference.md).
  FP8 matmuls quantise from float32: there every float leaf is upcast."""
  if matmul_dtype == 'compute':
    return params
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
  )
