"""`dlmjax.load_pretrained(path)`: a trained model behind numpy in, numpy out.

`path` is an orbax step directory, a run directory (its latest step) or a Hugging Face directory
(any architecture convert reads); the weights go to one device, or to a mesh when given one.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.checkpoint import manager
from dlmjax.checkpoint import safetensors_io

_DTYPE_NAMES = {'fp32': 'float32', 'bf16': 'bfloat16'}


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory: safetensors weights and no dlmjax checkpoints/."""
  return (os.path.isdir(path) and not os.path.isdir(os.path.join(path, manager.CHECKPOINT_DIR))
          and any(os.path.exists(os.path.join(path, n))
                  for n in (safetensors_io.SINGLE_FILE, safetensors_io.INDEX_FILE)))


class Pretrained:
  """Config, params and a jitted forward; `logits` returns the tokenizer's vocabulary."""

  def __init__(self, config, params: dict, source: str = ''):
    self.config = config
    self.params = params
    self.source = source
    self.model_config = model_lib.ModelConfig.from_config(config)
    cfg = self.model_config
    self._forward = jax.jit(lambda p, tokens: model_lib.merge(cfg, p)(tokens))

  @property
  def vocab_size(self) -> int:
    """The tokenizer's vocabulary (config.model.vocab_size), the last axis of `logits`."""
    return self.config.model.vocab_size

  def logits(self, tokens) -> np.ndarray:
    """numpy int tokens [B, L] -> float32 logits [B, L, vocab_size].

    The embedding's padding rows (Megatron pads to a multiple of 128) are cut off: they are never
    real tokens. One compilation per distinct (B, L).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f'tokens must be integers shaped [batch, length], got {tokens.dtype} '
                       f'{tokens.shape}.')
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
      raise ValueError(f'token ids must lie in [0, {self.vocab_size}); got '
                       f'[{tokens.min()}, {tokens.max()}].')
    logits = self._forward(self.params, tokens.astype(np.int32))
    return np.asarray(jax.device_get(logits[..., :self.vocab_size]), np.float32)


def load_pretrained(path: str, *, dtype: str | None = None, mesh=None,
                    missing_qk_norm: str = 'error') -> Pretrained:
  """Loads a checkpoint for inference.

  Args:
    path: step directory, run directory (latest step) or Hugging Face directory.
    dtype: compute dtype override ('float32' | 'bfloat16', or 'fp32' | 'bf16'); default: the run's.
    mesh: place params in the mesh's shardings (orbax checkpoints); default: one device.
    missing_qk_norm: for Hugging Face models without QK-norm, see `dlmjax.convert`.
  """
  path = os.path.abspath(path)
  if is_hf_dir(path):
    from dlmjax import convert  # pylint: disable=import-outside-toplevel
    config, params = convert.load_hf(path, missing_qk_norm=missing_qk_norm)
  else:
    run_dir, step_dir, _ = manager.resolve_step_dir(path)
    config = manager.load_run_config(run_dir)
    params = manager.restore_params(step_dir, config, mesh)
  if dtype is not None:
    config.model.dtype = _DTYPE_NAMES.get(dtype, dtype)
  if config.model.attention_backend == 'cudnn' and jax.default_backend() != 'gpu':
    config.model.attention_backend = 'xla'  # a GPU run's config, loaded on a CPU.
  return Pretrained(config, params, source=path)
