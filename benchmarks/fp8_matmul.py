"""One projection of the 1.7B in FP8 vs bf16 on one GPU: does XLA emit cuBLASLt FP8 GEMMs, and
how fast are they with and without the quantization around them?

    python -m benchmarks.fp8_matmul [--tokens 16384 --d_in 2048 --d_out 6144]

Prints one JSON line per variant (ms, TFLOP/s, FP8 GEMM custom calls in the compiled HLO) and
a `summary` line; docs/benchmarks.md ("FP8 matmuls") records its output.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from dlmjax.model import fp8

_F8_GEMM = '__cublas$lt$matmul$f8'


def timed_ms(fn, *args, repeats=5, iters=10):
  """Median over `repeats` of the mean time of `iters` back-to-back calls (after a warm-up)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / iters * 1e3)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--tokens', type=int, default=16384)  # micro-batch 8 x seq 2048
  parser.add_argument('--d_in', type=int, default=2048)
  parser.add_argument('--d_out', type=int, default=6144)
  a = parser.parse_args()
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (a.tokens, a.d_in), jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (a.d_in, a.d_out), jnp.float32)  # the float32 parameter
  g = jax.random.normal(kg, (a.tokens, a.d_out), jnp.bfloat16)
  x_q, x_s = fp8.quantize(x, fp8.E4M3)
  w_q, w_s = fp8.quantize(w, fp8.E4M3)

  def bf16_fwd(x, w):
    return x @ w.astype(x.dtype)

  def fp8_fwd(x, w):
    return fp8.dot(x, w)

  def fwd_bwd(f):
    def run(x, w, g):
      y, vjp = jax.vjp(f, x, w)
      return y, *vjp(g)

    return run

  def gemm_only(x_q, x_s, w_q, w_s):  # pre-quantized operands: the FP8 GEMM alone
    return jax.lax.dot(
      fp8.dequantize(x_q, x_s, jnp.bfloat16), fp8.dequantize(w_q, w_s, jnp.bfloat16)
    )

  flops = 2 * a.tokens * a.d_in * a.d_out
  variants = [
    ('bf16 forward', bf16_fwd, (x, w), 1),
    ('fp8 forward (quantize x, w + GEMM)', fp8_fwd, (x, w), 1),
    ('fp8 GEMM alone (operands quantized beforehand)', gemm_only, (x_q, x_s, w_q, w_s), 1),
    ('bf16 forward + backward', fwd_bwd(bf16_fwd), (x, w, g), 3),
    ('fp8 forward + backward', fwd_bwd(fp8_fwd), (x, w, g), 3),
  ]
  rows = {}
  for name, fn, args, gemms in variants:
    compiled = jax.jit(fn).lower(*args).compile()
    ms = timed_ms(compiled, *args)
    row = dict(
      variant=name,
      ms=round(ms, 3),
      tflops=round(gemms * flops / ms / 1e9, 1),
      fp8_gemm_calls=compiled.as_text().count(_F8_GEMM),
      shape=[a.tokens, a.d_in, a.d_out],
      device=jax.devices()[0].device_kind,
    )
    rows[name] = row
    print(json.dumps(row), flush=True)
  ref = bf16_fwd(x, w).astype(jnp.float32)
  rel = jnp.linalg.norm(fp8_fwd(x, w).astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
  print(
    json.dumps(
      dict(
        summary='fp8 matmul',
        forward_speedup=round(
          rows['bf16 forward']['ms'] / rows['fp8 forward (quantize x, w + GEMM)']['ms'], 3
        ),
        fwd_bwd_speedup=round(
          rows['bf16 forward + backward']['ms'] / rows['fp8 forward + backward']['ms'], 3
        ),
        forward_rel_err_vs_bf16=round(float(rel), 4),
      )
    ),
    flush=True,
  )


if __name__ == '__main__':
  main()
