"""The reference model of the KL term: the init model, restored again (also on resume), or with
rl.ref_sync_every > 0 a reference refreshed from the policy that lives in the train state.

Refresh (d1's sync_ref_model, TRL's SyncRefModelCallback): after every N-th optimizer step,
reference <- alpha * policy + (1 - alpha) * reference. d1 sets N = 64 (train.yaml
ref_model_sync_steps) and leaves alpha at TRL's ref_model_mixup_alpha default, 0.6; under PEFT
TRL has no separate reference to refresh, so a LoRA run keeps its frozen base.

Held in rl.reference_dtype, on the mesh with the training shardings, or in host memory
(rl.reference_on_host) and moved onto the mesh only while a rollout scores with it. In a LoRA
run it is the frozen base the adapters train on, with the adapters off (as d1 scores its
reference with PEFT's disable_adapter): no second copy of the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dlmjax.checkpoint import run_model
from dlmjax.parallel import distributed
from dlmjax.rl import choices


DTYPES = choices.REFERENCE_DTYPES  # rl.reference_dtype


def needed(config) -> bool:
  """A KL term (rl.kl_beta > 0) needs one; SPG and beta 0 train without."""
  return config.rl.kl_beta > 0


def synced(config) -> bool:
  """The reference is refreshed from the policy, so the train state holds it (key 'reference')."""
  return config.rl.ref_sync_every > 0 and needed(config)


def initial(config, params):
  """The train state's reference at step 0: the init params in rl.reference_dtype."""
  dtype = jnp.dtype(config.rl.reference_dtype)
  return jax.tree.map(lambda x: x.astype(dtype), params)


def refresh(new_step, reference, params, *, every: int, alpha: float):
  """The reference after optimizer step `new_step` (1-based, traced): alpha * params +
  (1 - alpha) * reference in float32 when new_step is a multiple of `every`, else unchanged."""

  def mix(reference):
    return jax.tree.map(
      lambda r, p: (alpha * p.astype(jnp.float32) + (1.0 - alpha) * r.astype(jnp.float32)).astype(
        r.dtype
      ),
      reference,
      params,
    )

  return jax.lax.cond(new_step % every == 0, mix, lambda r: r, reference)


class ReferenceModel:
  """params() and the model_config to run them with. `role` names what the reference is for in
  the line printed when it is restored (VRPO's is no KL term's)."""

  def __init__(self, config, setup, *, role: str = 'frozen KL reference model'):
    self._state_reference = None
    if synced(config):  # the train state's, handed over before each rollout (use)
      self.model_config, self._setup, self.on_host = setup.model_config, None, False
      self.synced = True
      return
    self.synced = False
    if setup.lora:
      self.model_config = dataclasses.replace(setup.model_config, lora_rank=0, lora_targets=())
      self._setup, self.on_host = setup, False
      return
    self.model_config, self._setup = setup.model_config, None
    self.on_host, self.shardings = config.rl.reference_on_host, setup.param_shardings
    dtype = jnp.dtype(config.rl.reference_dtype)
    params = run_model.source_params(config, setup.mesh, purpose=role)
    params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p))(params)
    self._params = jax.tree.map(distributed.to_host, params) if self.on_host else params

  def params(self):
    """The reference params on the mesh (moved there for this use when kept on the host)."""
    if self.synced:
      if self._state_reference is None:
        raise RuntimeError('the refreshed reference lives in the train state: call use() first.')
      return self._state_reference
    if self._setup is not None:
      return self._setup.frozen
    if self.on_host:
      return jax.tree.map(distributed.from_full_host, self._params, self.shardings)
    return self._params

  def use(self, state_reference) -> None:
    """Takes the train state's current reference (rl.ref_sync_every > 0) for the next rollout."""
    self._state_reference = state_reference
