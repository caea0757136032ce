"""VRPO (LLaDA 1.5, arXiv 2505.19223): DPO over ELBO estimates of log pi(y | x) for a masked DLM,
with the paper's variance reductions, each a switch.

The ELBO of a response y given prompt x is B(y|x) = E_t E_{y_t} l(y_t, t, y | x), with y_t each
response token masked independently w.p. t ~ U(0, 1] and l = (1/t) sum_{masked i} log p(y^i |
y_t, x) (LLaDA's 1/t form; the paper's review names "the per-step mask-prediction loss", so the
exact form is our choice). The estimate spends a budget of n = n_time x n_mask masked forwards:
n_time timesteps, n_mask masks at each. The paper's reductions:

- a larger budget n;
- optimal allocation, n_time = n and n_mask = 1 (one mask per timestep);
- antithetic sampling: the policy's and the reference's ELBOs use the same timesteps and masks,
  so the reference costs forwards but adds no randomness to B_theta - B_ref.

The chosen and the rejected response of a pair are always scored with the same per-row draws
(the same timesteps and per-position uniforms; whether the paper couples the pair is not stated
in the sources we could read). Loss: -log sigmoid(beta (B_theta(y_w) - B_ref(y_w)) - beta
(B_theta(y_l) - B_ref(y_l))).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.diffusion import loss as loss_lib

_VRPO_STREAM = 11  # keeps VRPO's draws apart from the other mask streams
POLICY_STREAM, INDEPENDENT_REFERENCE_STREAM = 0, 1
T_MIN = 1e-3  # t ~ U[T_MIN, 1]: the 1/t weight stays finite


def draws(key, length: int, n_time: int, n_mask: int):
  """One row's (t [n], uniforms [n, length]) for its n = n_time x n_mask masked copies: the
  timesteps repeat n_mask times; position i of copy k is masked when uniforms[k, i] < t[k]."""
  time_key, mask_key = jax.random.split(key)
  t = T_MIN + (1.0 - T_MIN) * jax.random.uniform(time_key, (n_time,))
  uniforms = jax.random.uniform(mask_key, (n_time * n_mask, length))
  return jnp.repeat(t, n_mask), uniforms


def row_keys(seed, mask_seeds_B, stream: int):
  """Each row's key for one draw stream (the policy's; the reference's own when not antithetic)."""
  base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _VRPO_STREAM), stream)
  return jax.vmap(lambda s: jax.random.fold_in(base, s))(mask_seeds_B)


def elbo(
  module,
  tokens_BL,
  prompt_lengths_B,
  keys_B,
  *,
  n_time: int,
  n_mask: int,
  mask_id: int,
  chunk_size: int = 0,
):
  """B-hat(y | x) [B] float32: the mean over n_time x n_mask masked copies of (1/t) times the
  summed log-probabilities of the masked response tokens (positions >= prompt length; the whole
  row is the response, its EOS padding included, as SFT trains it). One forward of B rows per
  copy, in a scan (memory of one copy's activations)."""
  batch, length = tokens_BL.shape
  t_BN, u_BNL = jax.vmap(lambda k: draws(k, length, n_time, n_mask))(keys_B)
  response_BL = jnp.arange(length)[None] >= prompt_lengths_B[:, None]

  def one_copy(total_B, copy):
    t_B, u_BL = t_BN[:, copy], u_BNL[:, copy]
    masked_BL = response_BL & (u_BL < t_B[:, None])
    noisy_BL = jnp.where(masked_BL, mask_id, tokens_BL)
    ce_BL = loss_lib.model_cross_entropy(module, noisy_BL, tokens_BL, chunk_size=chunk_size)
    return total_B - jnp.sum(jnp.where(masked_BL, ce_BL, 0.0), -1) / t_B, None

  total_B, _ = jax.lax.scan(one_copy, jnp.zeros((batch,), jnp.float32), jnp.arange(n_time * n_mask))
  return total_B / (n_time * n_mask)


def dpo_loss(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B, *, beta: float):
  """(loss [B], margin [B]): -log sigmoid(beta * margin), margin = (B_theta(y_w) - B_ref(y_w)) -
  (B_theta(y_l) - B_ref(y_l)), the implicit reward's chosen-minus-rejected gap."""
  margin_B = (chosen_B - ref_chosen_B) - (rejected_B - ref_rejected_B)
  return -jax.nn.log_sigmoid(beta * margin_B), margin_B
