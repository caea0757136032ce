"""The frozen reference model of the KL term: the init model, restored again (also on resume).

Held in rl.reference_dtype, on the mesh with the training shardings, or in host memory
(rl.reference_on_host) and moved onto the mesh only while a rollout scores with it. In a LoRA
run it is the frozen base the adapters train on, with the adapters off (as d1 scores its
reference with PEFT's disable_adapter): no second copy of the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dlmjax.checkpoint import init_from
from dlmjax.parallel import distributed


def needed(config) -> bool:
  """A KL term (rl.kl_beta > 0) needs one; SPG and beta 0 train without."""
  return config.rl.kl_beta > 0


class ReferenceModel:
  """params() and the model_config to run them with."""

  def __init__(self, config, setup):
    if setup.lora:
      self.model_config = dataclasses.replace(setup.model_config, lora_rank=0, lora_targets=())
      self._setup, self.on_host = setup, False
      return
    self.model_config, self._setup = setup.model_config, None
    self.on_host, self.shardings = config.rl.reference_on_host, setup.param_shardings
    dtype = jnp.dtype(config.rl.reference_dtype)
    params = init_from.restore_params(config, setup, purpose='frozen KL reference model')
    params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p))(params)
    self._params = jax.tree.map(distributed.to_host, params) if self.on_host else params

  def params(self):
    """The reference params on the mesh (moved there for this use when kept on the host)."""
    if self._setup is not None:
      return self._setup.frozen
    if self.on_host:
      return jax.tree.map(distributed.from_full_host, self._params, self.shardings)
    return self._params
