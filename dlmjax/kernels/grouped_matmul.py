"""The grouped matmul of MoE experts: rows of lhs sorted by group, each group times its own matrix.

out[r] = lhs[r] @ rhs[g(r)], g(r) the group row r falls in (group_sizes consecutive rows each);
rows past sum(group_sizes) belong to no group. Backends:
- pallas: our own Pallas kernels (grouped_matmul_pallas.py: Triton on GPU, interpret mode off
  it), forward and backward without any dense [G, M, ...] buffer; on one H200 112x XLA's
  forward and 63% of a dense matmul's rate (docs/benchmarks.md, MoE).
- tokamax: tokamax's ragged_dot (Google's Pallas kernel library, the optional `moe` extra; its
  import needs xprof), or one clear error where it fails (0.0.12 under jax 0.11.2).
- xla: `jax.lax.ragged_dot`; on GPU its backward expands the groups densely (tens of GiB at the
  MoE presets' shapes), off GPU it is the fast path.
auto takes pallas on GPU and xla elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dlmjax import config as config_lib
from dlmjax.kernels import choices, grouped_matmul_pallas

BACKENDS = choices.GROUPED_MATMUL_BACKENDS  # model.moe.backend


@functools.cache
def _tokamax():
  """tokamax's module, or None where it does not import (not installed, or xprof missing)."""
  try:
    import tokamax  # noqa: PLC0415 - optional extra
  except Exception:  # noqa: BLE001 - any import failure means: not available
    return None
  from absl import flags  # noqa: PLC0415

  # tokamax reads its settings from absl flags; a program that parses none of its own (pytest,
  # the argparse entry points) would fail there on its first call.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def tokamax_available() -> bool:
  return _tokamax() is not None


def resolve(backend: str = 'auto') -> str:
  """'xla', 'tokamax' or 'pallas': auto takes pallas on GPU (measured: docs/benchmarks.md, MoE)."""
  if backend not in BACKENDS:
    raise ValueError(f'grouped matmul backend {backend!r} is not one of {BACKENDS}.')
  if backend == 'auto':
    return 'pallas' if jax.default_backend() == 'gpu' else 'xla'
  if backend == 'tokamax' and not tokamax_available():
    raise config_lib.ConfigError(
      'model.moe.backend=tokamax: tokamax does not import; pip install ".[moe]" (tokamax and '
      'xprof) or set --config.model.moe.backend=auto.'
    )
  return backend


def grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, *, backend: str = 'auto', layer=None):
  """[M, K] x [G, K, N] -> [M, N] in lhs's dtype (float32 accumulation); rows outside every
  group come out zero whatever the kernel leaves there, and get a zero gradient.

  layer (inference only, no gradient): rhs is a stack [layers, G, K, N] and the product is with
  rhs[layer]. pallas reads that layer in place; xla and tokamax take the slice first (the same
  values), which off GPU costs nothing that matters."""
  if resolve(backend) == 'pallas':  # zero outside the groups by construction (masked loads)
    return grouped_matmul_pallas.grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, layer=layer)
  if layer is not None:
    rhs_GKN = jax.lax.dynamic_index_in_dim(rhs_GKN, layer, 0, keepdims=False)
  rows = jnp.arange(lhs_MK.shape[0])
  in_group_M = rows < jnp.sum(group_sizes_G)
  # Masked on the way in too: a kernel may leave anything in rows it does not own, and the
  # backward's lhs gradient would carry it.
  lhs_MK = jnp.where(in_group_M[:, None], lhs_MK, jnp.zeros((), lhs_MK.dtype))
  rhs_GKN = rhs_GKN.astype(lhs_MK.dtype)
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  out = None
  if resolve(backend) == 'tokamax':
    out = _tokamax_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G)
  else:
    out = jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=jnp.float32)
  return jnp.where(in_group_M[:, None], out, 0.0).astype(lhs_MK.dtype)


_TOKAMAX_IMPLEMENTATIONS = ('mosaic', 'triton')
_failures: dict[str, str] = {}  # implementation -> the error it raised while tracing


def _tokamax_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G):
  """tokamax's ragged_dot through the first implementation that traces here, else one error
  naming each failure. A tokamax release built for another jax can fail inside its kernel (0.0.12
  under jax 0.11.2: Mosaic GPU's Mesh lost a keyword), which tokamax's own fallback chain does not
  catch."""
  error = None
  for implementation in _TOKAMAX_IMPLEMENTATIONS:
    if implementation in _failures:
      continue
    try:
      return _tokamax().ragged_dot(
        lhs_MK,
        rhs_GKN,
        group_sizes_G,
        preferred_element_type=jnp.float32,
        implementation=implementation,
      )
    except Exception as e:  # noqa: BLE001 - any failure to trace: the next implementation
      error = e
      _failures[implementation] = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'
  raise config_lib.ConfigError(
    f'model.moe.backend=tokamax: grouped matmul backend tokamax failed here ({_failures}); use '
    'backend pallas (GPU) or xla (--config.model.moe.backend=auto picks one), or a tokamax '
    'release built for this jax.'
  ) from error
