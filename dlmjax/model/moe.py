"""The mixture-of-experts feed-forward layer: a router picks experts_per_token of num_experts
SwiGLU experts for each token; their outputs, weighted, replace the dense MLP's.

Routers (model.moe.router):
- softmax_topk: p = softmax(logits) in float32, the top-k of p, weights renormalised to sum to one
  (transformers' Qwen3-MoE with norm_topk_prob).
- softmax_topk_raw: the same top-k, weights the raw p values (LLaDA-MoE and OLMoE: no
  renormalisation).
- sigmoid_bias: s = sigmoid(logits); experts chosen by the top-k of s + b, weights the chosen s
  renormalised (DeepSeek-V3), the top-k taken among the token's model.moe.router_group_topk best of
  model.moe.router_groups expert groups when those are set (group-limited routing, DeepSeek-V3's and
  LLaDA2's n_group / topk_group). b, one value per expert and layer, only selects: it gets no
  gradient. Loss-free balancing moves it after each step by rate x sign(mean load - load), so
  overloaded experts become less likely (`balance_bias`, which the train step applies: b lives in
  the params and so in the train state and its checkpoints, and resumes exactly).
Every router's weights are multiplied by model.moe.routed_scale (routed_scaling_factor: LLaDA2's
2.5).

Block routing (model.moe.block_experts = C > 0; LLaDA2.2's report, section 2.2: "token racing"):
the tokens of one diffusion block (model.block_size consecutive positions of the forward, as the
block-causal mask counts them) share a pool of C experts, the C best by their best score over
the block's tokens (g_j = max_i of the router's selection score); each token then takes its
top-k among the pool only. A block then touches at most C experts (k x block_size without it),
which bounds the experts a batch-1 decode step reads. The report leaves open how the pool meets
group-limited routing and the expert bias; here the admission score is the selection score the
token's top-k ranks by (biased, and -inf outside the token's kept groups), and a token whose kept
groups hold fewer than k admitted experts gives its missing choices weight 0 and its block's
first pool expert (`pool_first`), so the grouped matmul runs no expert outside the pool.

Dispatch is dropless: every (token, choice) assignment is sorted by expert, the experts run as a
grouped matmul over their contiguous rows (kernels/grouped_matmul.py), and the outputs go back
to their tokens, weighted (`dispatch`: `run_experts`, then `combine`). With a mesh the experts
are sharded over `expert` (and their hidden width over `tensor`), and model.moe.exchange picks how
tokens reach them (`_sharded_dispatch`; docs/moe.md, expert parallelism):
- gather: each device gathers the tokens of its `expert` group, runs its own experts on the
  assignments that chose them, and a reduce-scatter returns every token its summed output.
- all_to_all: each device sends its assignments to the devices of their experts, which run them
  and send the outputs back (`exchange_dispatch`). The exchange is a dense all-to-all of a
  worst-case buffer, so it stays dropless.

Every layer also returns its router statistics as additive sums (`moe_stats.layer_sums`);
model/moe_stats.py forms the load-balancing and z losses from them and collects them for the
train step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from dlmjax.kernels import grouped_matmul as gmm
from dlmjax.model import choices, layers, moe_stats
from dlmjax.parallel import rules

ROUTERS = choices.MOE_ROUTERS
BIAS = 'router_bias'  # the sigmoid_bias router's selection bias, a param with no gradient.
EXCHANGES = choices.MOE_EXCHANGES  # model.moe.exchange


class MoE(nnx.Module):
  """Router, experts [E, D, F] (gate, up) and [E, F, D] (down), and optional shared experts (one
  dense SwiGLU of width shared_ffn_dim that every token passes through, DeepSeek-style)."""

  def __init__(
    self,
    d_model: int,
    num_experts: int,
    experts_per_token: int,
    ffn_dim: int,
    *,
    router: str,
    shared_ffn_dim: int,
    router_groups: int = 1,
    router_group_topk: int = 1,
    routed_scale: float = 1.0,
    std: float,
    out_std: float,
    rngs: nnx.Rngs,
    num_stacked: int = 0,
    backend: str = 'auto',
    exchange: str = 'gather',
    fused: bool = False,
    block_experts: int = 0,
    block_size: int = 0,
  ):
    """fused: the shared experts' gate / up as one weight (layers.MLP, the inference layout);
    the routed experts keep theirs (their grouped matmuls take gate and up apart).
    block_experts: C of block routing over blocks of block_size positions (0 = token routing)."""
    if router not in ROUTERS:
      raise ValueError(f'model.moe.router={router!r} is not one of {ROUTERS}.')
    if exchange not in EXCHANGES:
      raise ValueError(f'model.moe.exchange={exchange!r} is not one of {EXCHANGES}.')
    if not 0 < experts_per_token <= num_experts:
      raise ValueError(
        f'model.moe.experts_per_token={experts_per_token} must be in [1, model.moe.num_experts='
        f'{num_experts}]; lower it.'
      )
    if num_experts % router_groups or not 0 < router_group_topk <= router_groups:
      raise ValueError(
        f'model.moe.router_groups={router_groups} must divide model.moe.num_experts='
        f'{num_experts} and '
        f'model.moe.router_group_topk={router_group_topk} be in [1, router_groups].'
      )
    if block_experts and not (experts_per_token <= block_experts <= num_experts and block_size):
      raise ValueError(
        f'model.moe.block_experts={block_experts} must lie in [experts_per_token='
        f'{experts_per_token}, num_experts={num_experts}] (0 = token routing) with '
        f'model.block_size > 0 (is {block_size}); change model.moe.block_experts.'
      )
    self.num_experts, self.top_k, self.router = num_experts, experts_per_token, router
    self.block_experts, self.block_size = block_experts, block_size
    self.groups, self.group_topk, self.routed_scale = router_groups, router_group_topk, routed_scale
    self.backend, self.exchange = backend, exchange
    kw = dict(num_stacked=num_stacked)
    self.router_kernel = layers.stacked_param(
      rngs, (d_model, num_experts), (rules.EMBED, None), std=std, **kw
    )
    if router == 'sigmoid_bias':
      setattr(self, BIAS, layers.stacked_param(rngs, (num_experts,), (None,), zeros=True, **kw))
    up_axes = (rules.EXPERT, rules.EMBED, rules.MLP)
    shape = (num_experts, d_model, ffn_dim)
    self.gate_proj = layers.stacked_param(rngs, shape, up_axes, std=std, **kw)
    self.up_proj = layers.stacked_param(rngs, shape, up_axes, std=std, **kw)
    self.down_proj = layers.stacked_param(
      rngs,
      (num_experts, ffn_dim, d_model),
      (rules.EXPERT, rules.MLP, rules.EMBED),
      std=out_std,
      **kw,
    )
    if shared_ffn_dim:
      self.shared = layers.MLP(
        d_model, shared_ffn_dim, std=std, out_std=out_std, rngs=rngs, fused=fused, **kw
      )

  def route(self, x_BLD):
    """(expert ids [B, L, k], their weights [B, L, k] float32, this layer's
    `moe_stats.layer_sums`)."""
    logits_BLE = jnp.einsum(
      'bld,de->ble', x_BLD.astype(jnp.float32), self.router_kernel.value.astype(jnp.float32)
    )
    if self.router == 'sigmoid_bias':
      scores_BLE = jax.nn.sigmoid(logits_BLE)
      bias_E = jax.lax.stop_gradient(getattr(self, BIAS).value)
      choice_BLE = _group_limited(scores_BLE + bias_E[None, None, :], self.groups, self.group_topk)
      probs_BLE = scores_BLE / jnp.sum(scores_BLE, -1, keepdims=True)
      weights_of_BLE = scores_BLE
    else:
      probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
      choice_BLE = weights_of_BLE = probs_BLE
    if self.block_experts:
      choice_BLE = block_pool(choice_BLE, self.block_experts, self.block_size)
    chosen_BLK, experts_BLK = jax.lax.top_k(choice_BLE, self.top_k)
    weights_BLK = jnp.take_along_axis(weights_of_BLE, experts_BLK, axis=-1)
    # Only block routing can leave a token fewer than k candidates (its choice -inf): weight 0.
    valid_BLK = chosen_BLK > -jnp.inf
    weights_BLK = jnp.where(valid_BLK, weights_BLK, 0.0)
    if self.block_experts:  # ... and its block's best expert, so that it runs no expert outside
      experts_BLK = jnp.where(valid_BLK, experts_BLK, pool_first(choice_BLE, self.block_size))
    if self.router != 'softmax_topk_raw':
      weights_BLK = weights_BLK / jnp.maximum(jnp.sum(weights_BLK, -1, keepdims=True), 1e-20)
    if self.routed_scale != 1.0:
      weights_BLK = weights_BLK * self.routed_scale
    return experts_BLK, weights_BLK, moe_stats.layer_sums(logits_BLE, probs_BLE, experts_BLK)

  def __call__(self, x_BLD, layer=None):
    """(output [B, L, D] in x's dtype, this layer's router statistics as `moe_stats.layer_sums`).

    layer: the routed experts' weights hold every layer of the stack ([layers, E, ...], the
    inference layout: transformer._run_layers) and this layer is number `layer` of them; the
    grouped matmul reads it in place (kernels/grouped_matmul.py)."""
    experts_BLK, weights_BLK, stats = self.route(x_BLD)
    w = [p.value.astype(x_BLD.dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)]
    out_BLD = _sharded_dispatch(
      x_BLD,
      experts_BLK,
      weights_BLK,
      *w,
      backend=self.backend,
      exchange=self.exchange,
      layer=layer,
    )
    if hasattr(self, 'shared'):
      out_BLD = out_BLD + self.shared(x_BLD)
    return out_BLD, stats


def block_pool(choice_BLE, pool: int, block_size: int):
  """choice with every expert outside its block's pool at -inf: the blocks are block_size
  consecutive positions along L (a last partial block counts as one), and a block's pool is the
  `pool` experts of the highest best choice over its tokens (LLaDA2.2's block routing)."""
  length = choice_BLE.shape[1]
  best_BNE = _block_best(choice_BLE, block_size)
  _, admitted_BNC = jax.lax.top_k(best_BNE, pool)
  admitted_BNE = jnp.zeros(best_BNE.shape, bool)
  admitted_BNE = jax.vmap(jax.vmap(lambda row, ids: row.at[ids].set(True)))(
    admitted_BNE, admitted_BNC
  )
  admitted_BLE = jnp.repeat(admitted_BNE, block_size, axis=1)[:, :length]
  return jnp.where(admitted_BLE, choice_BLE, -jnp.inf)


def _block_best(choice_BLE, block_size: int):
  """[B, blocks, E]: each expert's best choice over each block's positions."""
  batch, length, experts = choice_BLE.shape
  blocks = -(-length // block_size)
  padded = jnp.pad(
    choice_BLE, ((0, 0), (0, blocks * block_size - length), (0, 0)), constant_values=-jnp.inf
  )
  return jnp.max(padded.reshape(batch, blocks, block_size, experts), axis=2)


def pool_first(pooled_BLE, block_size: int):
  """int32 [B, L, 1]: the first expert of each position's block pool (from the pooled choice).
  A token's weight-0 choices point at it: an expert outside the pool would cost the grouped
  matmul a read of its weights for nothing."""
  best_BN = jnp.argmax(_block_best(pooled_BLE, block_size), axis=-1).astype(jnp.int32)
  return jnp.repeat(best_BN, block_size, axis=1)[:, : pooled_BLE.shape[1], None]


def _group_limited(scores_BLE, groups: int, group_topk: int):
  """scores with every expert outside a token's group_topk best groups at -inf (DeepSeek-V3's and
  LLaDA2's group-limited routing): the E experts form `groups` equal groups in order, a group
  scores the sum of its two highest scores (its one score when a group holds one expert)."""
  if groups == 1:
    return scores_BLE
  grouped_BLGe = scores_BLE.reshape(*scores_BLE.shape[:-1], groups, -1)
  best = jax.lax.top_k(grouped_BLGe, min(2, grouped_BLGe.shape[-1]))[0]
  _, kept_BLg = jax.lax.top_k(best.sum(-1), group_topk)
  keep_BLG = jnp.any(kept_BLg[..., :, None] == jnp.arange(groups)[None, None, None, :], axis=-2)
  masked = jnp.where(keep_BLG[..., None], grouped_BLGe, -jnp.inf)
  return masked.reshape(scores_BLE.shape)


def dispatch(
  x_TD,
  experts_TK,
  weights_TK,
  gate_EDF,
  up_EDF,
  down_EFD,
  *,
  first_expert=0,
  backend='auto',
  layer=None,
):
  """sum_k weights[t, k] * Expert_{experts[t, k]}(x[t]) over the experts held here: global ids
  [first_expert, first_expert + E_local); assignments to other experts add nothing. layer: the
  weights are stacks [layers, E_local, ...] of which this is one (`run_experts`)."""
  k = experts_TK.shape[1]
  y_AD = run_experts(
    x_TD,
    experts_TK.reshape(-1) - first_expert,
    gate_EDF,
    up_EDF,
    down_EFD,
    rows_per_token=k,
    backend=backend,
    layer=layer,
  )
  return combine(y_AD, weights_TK, x_TD.dtype)


def run_experts(
  x_RD, local_A, gate_EDF, up_EDF, down_EFD, *, rows_per_token=1, backend='auto', layer=None
):
  """y[a] = Expert_{local[a]}(x[a // rows_per_token]) for every assignment a, in a's order; zero
  where local[a] is not in [0, E_local) (an expert held elsewhere, or a padding row).

  The assignments are sorted by expert and the experts run as a grouped matmul over their
  contiguous rows; the rows are gathered from x in sorted order, so no sorted copy of x is
  built first. layer: the weights are stacks [layers, E_local, ...], read at that layer in place
  (kernels/grouped_matmul.py)."""
  local_experts = gate_EDF.shape[-3]
  gmm_kw = dict(backend=backend, layer=layer)
  # Assignments to experts held elsewhere sort last, past every group.
  key_A = jnp.where((local_A >= 0) & (local_A < local_experts), local_A, local_experts)
  order_A = jnp.argsort(key_A, stable=True)
  group_sizes = jnp.bincount(key_A, length=local_experts + 1)[:local_experts].astype(jnp.int32)
  x_AD = jnp.take(x_RD, order_A // rows_per_token, axis=0)
  # The dense MLP's activation names (model/transformer.py REMAT_POLICIES): the policies that
  # keep its projections keep the experts' too, instead of re-running the grouped matmuls.
  gate_AF = checkpoint_name(gmm.grouped_matmul(x_AD, gate_EDF, group_sizes, **gmm_kw), 'mlp_gate')
  up_AF = checkpoint_name(gmm.grouped_matmul(x_AD, up_EDF, group_sizes, **gmm_kw), 'mlp_up')
  hidden_AF = checkpoint_name(jax.nn.silu(gate_AF) * up_AF, 'mlp_hidden')
  y_AD = checkpoint_name(gmm.grouped_matmul(hidden_AF, down_EFD, group_sizes, **gmm_kw), 'mlp_out')
  return jnp.take(y_AD, jnp.argsort(order_A), axis=0)


def combine(y_AD, weights_TK, dtype):
  """sum_k weights[t, k] * y[t * k + k'] (assignments in token-major order), in float32."""
  tokens, k = weights_TK.shape
  y_TKD = y_AD.reshape(tokens, k, -1)
  out_TD = jnp.einsum(
    'tkd,tk->td', y_TKD, weights_TK.astype(y_TKD.dtype), preferred_element_type=jnp.float32
  )
  return out_TD.astype(dtype)


def exchange_dispatch(
  x_TD, experts_TK, weights_TK, gate, up, down, *, axis, shards, backend, layer=None
):
  """`dispatch` of this device's tokens over experts split across `shards` devices of mesh axis
  `axis` (inside shard_map), the assignments exchanged by all-to-all.

  Each device sorts its (token, choice) assignments by expert, and so by destination shard
  (global expert // E_local), and writes them to a send buffer [shards, C, D]; one all-to-all
  hands every device the rows for its own experts from every source, which run through
  `run_experts` (padding rows carry an out-of-range id: they sort last and come out zero); the
  reverse all-to-all returns each row to its slot, the slots are unsorted to (token, choice)
  order and `combine` weights them. Dropless: C is the worst case one device can send to one
  shard, T x min(k, E_local) (a token's k choices are distinct experts), whatever the routing.

  A dense all-to-all (jax.lax.all_to_all), not ragged_all_to_all: XLA:CPU has no
  ragged-all-to-all (jax 0.10.2: UNIMPLEMENTED in its thunk emitter), and the tests run there.
  Cost per layer and device: two all-to-alls of shards x C x D (the buffer moves whole, padding
  included) and one of the int32 expert ids, so min(k, E_local) times the gather path's
  all-gather + reduce-scatter of shards x T x D (equal when E_local = 1); the grouped matmul
  runs shards x C rows, at most the gather path's shards x T x k. A ragged exchange would move
  only the real rows, T x k at any balance.
  """
  tokens, k = experts_TK.shape
  local_experts = gate.shape[-3]
  capacity = tokens * min(k, local_experts)
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)  # by expert, so by destination shard
  sorted_A = experts_A[order_A]
  dest_A = sorted_A // local_experts
  counts_S = jnp.bincount(dest_A, length=shards)
  starts_S = jnp.cumsum(counts_S) - counts_S
  slot_A = jnp.arange(order_A.shape[0]) - starts_S[dest_A]  # the row's place in its shard's chunk
  # Send buffers; padding rows keep the local id local_experts (no expert anywhere).
  send_SCD = jnp.zeros((shards, capacity, x_TD.shape[1]), x_TD.dtype)
  send_SCD = send_SCD.at[dest_A, slot_A].set(jnp.take(x_TD, order_A // k, axis=0))
  ids_SC = jnp.full((shards, capacity), local_experts, jnp.int32)
  ids_SC = ids_SC.at[dest_A, slot_A].set((sorted_A % local_experts).astype(jnp.int32))
  # Chunk s goes to shard s; what arrives is [source, C, ...].
  recv_SCD = jax.lax.all_to_all(send_SCD, axis, 0, 0)
  recv_ids_SC = jax.lax.all_to_all(ids_SC, axis, 0, 0)
  y_RD = run_experts(
    recv_SCD.reshape(shards * capacity, -1),
    recv_ids_SC.reshape(-1),
    gate,
    up,
    down,
    backend=backend,
    layer=layer,
  )
  back_SCD = jax.lax.all_to_all(y_RD.reshape(shards, capacity, -1), axis, 0, 0)
  y_sorted_AD = back_SCD[dest_A, slot_A]
  y_AD = jnp.take(y_sorted_AD, jnp.argsort(order_A), axis=0)
  return combine(y_AD, weights_TK, x_TD.dtype)


def _sharded_dispatch(
  x_BLD, experts_BLK, weights_BLK, gate, up, down, *, backend, exchange='gather', layer=None
):
  """`dispatch` on every device of the activation mesh (plainly without one); exchange (one of
  EXCHANGES, model.moe.exchange) picks how tokens meet the experts split over `expert`.

  Expert parallelism by gathering: the tokens of the devices in one `expert` group are
  all-gathered (each device then holds expert x its rows), every device runs its E / expert
  experts on the assignments that chose them, and a reduce-scatter over `expert` sums each
  token's partial outputs and returns them to the rows' owner; with `tensor`, each device holds
  F / tensor of every expert's width and a sum over `tensor` completes the down projection. Cost
  per layer: an all-gather and a reduce-scatter of expert x the local activations over `expert`
  (a ragged all-to-all would move only the assignments, k / expert of that at balance), and the
  grouped matmul's row buffer holds expert x the local assignments. Expert weights are gathered
  over `fsdp` on the way in, as any FSDP weight.

  exchange='all_to_all' moves the assignments instead (`exchange_dispatch`: its docstring gives
  its cost); each device keeps its own rows, so no reduce-scatter, and `tensor` is summed as
  above. Rows replicated over the mesh need no exchange either way: both take the gather path,
  which then gathers nothing. layer: the weights are stacks [layers, E, ...] (MoE.__call__), split
  the same way behind their layers axis.
  """
  if exchange not in EXCHANGES:
    raise ValueError(f'model.moe.exchange={exchange!r} is not one of {EXCHANGES}.')
  mesh = rules.current_mesh()
  expert_axis = tensor_axis = None
  stream = P()
  if mesh is not None and mesh.size > 1:
    expert_axis = 'expert' if mesh.shape.get('expert', 1) > 1 else None
    tensor_axis = 'tensor' if mesh.shape.get('tensor', 1) > 1 else None
    stream = rules.spec((rules.BATCH, rules.LENGTH, rules.ACT_EMBED))
    if x_BLD.shape[0] % _axes_size(mesh, stream[0]) or x_BLD.shape[1] % _axes_size(mesh, stream[1]):
      stream = P()  # rows the batch axes cannot split (a one-row sampler batch): replicated.
  # Replicated rows: every device already holds every token, so no gather, and a sum over
  # `expert` in place of the reduce-scatter.
  split_rows = stream != P()

  def body(x, experts, weights, gate, up, down, layer=None):
    exchanged = expert_axis and split_rows and exchange == 'all_to_all'
    first = 0
    if expert_axis and not exchanged:
      if split_rows:
        x, experts, weights = (
          jax.lax.all_gather(a, expert_axis, axis=0, tiled=True) for a in (x, experts, weights)
        )
      first = jax.lax.axis_index(expert_axis) * gate.shape[-3]
    rows, length, dim = x.shape
    flat = [a.reshape(rows * length, -1) for a in (x, experts, weights)]
    if exchanged:
      shards = mesh.shape[expert_axis]
      out = exchange_dispatch(
        *flat, gate, up, down, axis=expert_axis, shards=shards, backend=backend, layer=layer
      )
    else:
      out = dispatch(*flat, gate, up, down, first_expert=first, backend=backend, layer=layer)
    out = out.reshape(rows, length, dim)
    if tensor_axis:
      out = jax.lax.psum(out, tensor_axis)
    if exchanged:
      return out
    if expert_axis and split_rows:
      out = jax.lax.psum_scatter(out, expert_axis, scatter_dimension=0, tiled=True)
    elif expert_axis:
      out = jax.lax.psum(out, expert_axis)
    return out

  operands = (x_BLD, experts_BLK, weights_BLK, gate, up, down)
  if layer is not None:  # an operand (replicated), not a tracer the mapped body closes over
    operands += (jnp.asarray(layer, jnp.int32),)
  if mesh is None or mesh.size == 1:
    return body(*operands)
  stack = (None,) * (layer is not None)  # the weights' layers axis, whole on every device
  wide, narrow = P(*stack, 'expert', None, 'tensor'), P(*stack, 'expert', 'tensor', None)
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(stream, stream, stream, wide, wide, narrow, P())[: len(operands)],
    out_specs=stream,
    check_vma=False,
  )(*operands)


def _axes_size(mesh, part) -> int:
  if part is None:
    return 1
  names = part if isinstance(part, tuple) else (part,)
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def balance_bias(params: dict, counts_LE, rate: float, *, old: dict | None = None) -> dict:
  """params with every sigmoid_bias router's bias moved by rate x sign(mean load - load)
  (DeepSeek-V3's loss-free balancing) from its value in `old` (default: params); counts_LE: the
  step's assignments per MoE layer and expert, in layer order (a model with dense layers holds
  its MoE layers in several stacks, ModelConfig.layer_runs: their rows follow one another)."""
  error_LE = jnp.mean(counts_LE, axis=-1, keepdims=True) - counts_LE
  out, row = dict(params), 0
  for key in sorted((k for k in params if k.startswith('blocks')), key=_run_index):
    mlp = params[key].get('mlp', {})
    if BIAS not in mlp:
      continue
    bias_LE = (old or params)[key]['mlp'][BIAS]
    step_LE = rate * jnp.sign(error_LE[row : row + bias_LE.shape[0]]).astype(bias_LE.dtype)
    row += bias_LE.shape[0]
    out[key] = dict(params[key], mlp=dict(mlp, **{BIAS: bias_LE + step_LE}))
  return out


def _run_index(key: str) -> int:
  """0 for `blocks`, r for `blocks_r` (presets.run_key)."""
  return int(key.rpartition('_')[2]) if '_' in key else 0
