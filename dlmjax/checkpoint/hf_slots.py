"""Our per-layer parameter slots and their Hugging Face layouts, shared by export and import.

Ours: one array per parameter kind stacked over layers (leading axis L; an MoE model with dense
layers stacks each run of layers of one kind under its own key, ModelConfig.layer_runs, and
layer i's tensors come from its run's slice), attention kernels split
by head ([D, N, H], [N, H, D]), matmul kernels as [in, out]. Hugging Face: one tensor per layer,
nn.Linear weights as [out, in]. This module holds the slot table (where each slot lives in our
param dict and its layout kind), the shapes on both sides and the layout transforms;
hf_export and hf_import walk it in the two directions (hf_mapping is their entry point).
"""

from __future__ import annotations

from dlmjax.checkpoint import families
from dlmjax.model.presets import ModelConfig


class MappingError(ValueError):
  """Tensors that do not fit the model: names the tensor, what was expected and what was found."""


Naming = families.base.Naming
# Each family's tensor names (checkpoint/families: its module's Naming).
NAMINGS = {name: family.names for name, family in families.FAMILIES.items()}

# Our per-layer slots: path in the param dict and layout kind.
#   vector:    [X]        <-> [X]
#   in_heads:  [D, X, H]  <-> [X*H, D]   (q/k/v: nn.Linear(D, X*H))
#   heads_out: [N, H, D]  <-> [D, N*H]   (o:     nn.Linear(N*H, D))
#   matrix:    [I, O]     <-> [O, I]     (MLP)
#   bias:      [X, H]     <-> [X*H]      (q/k/v biases)
#   experts:   [E, I, O]  <-> E tensors [O, I], one per expert (`{e}` in the name)
SLOTS = {
  'input_norm': (('blocks', 'input_norm', 'scale'), 'vector'),
  'q': (('blocks', 'attn', 'q_proj'), 'in_heads'),
  'q_bias': (('blocks', 'attn', 'q_bias'), 'bias'),
  'k': (('blocks', 'attn', 'k_proj'), 'in_heads'),
  'k_bias': (('blocks', 'attn', 'k_bias'), 'bias'),
  'v': (('blocks', 'attn', 'v_proj'), 'in_heads'),
  'v_bias': (('blocks', 'attn', 'v_bias'), 'bias'),
  'q_norm': (('blocks', 'attn', 'q_norm', 'scale'), 'vector'),
  'k_norm': (('blocks', 'attn', 'k_norm', 'scale'), 'vector'),
  'o': (('blocks', 'attn', 'o_proj'), 'heads_out'),
  'post_attn_norm': (('blocks', 'post_attn_norm', 'scale'), 'vector'),
  'gate': (('blocks', 'mlp', 'gate_proj'), 'matrix'),
  'up': (('blocks', 'mlp', 'up_proj'), 'matrix'),
  'down': (('blocks', 'mlp', 'down_proj'), 'matrix'),
  'router': (('blocks', 'mlp', 'router_kernel'), 'matrix'),
  'router_bias': (('blocks', 'mlp', 'router_bias'), 'vector'),
  'expert_gate': (('blocks', 'mlp', 'gate_proj'), 'experts'),
  'expert_up': (('blocks', 'mlp', 'up_proj'), 'experts'),
  'expert_down': (('blocks', 'mlp', 'down_proj'), 'experts'),
  'shared_gate': (('blocks', 'mlp', 'shared', 'gate_proj'), 'matrix'),
  'shared_up': (('blocks', 'mlp', 'shared', 'up_proj'), 'matrix'),
  'shared_down': (('blocks', 'mlp', 'shared', 'down_proj'), 'matrix'),
}
EMBED, FINAL_NORM, LM_HEAD = ('embed_tokens',), ('final_norm', 'scale'), ('lm_head',)
SCORE = 'score.weight'  # transformers' *ForSequenceClassification head [num_labels, D]
QK_NORM_SLOTS = ('q_norm', 'k_norm')
_BIAS_SLOTS = ('q_bias', 'k_bias', 'v_bias')
_DENSE_SLOTS = ('gate', 'up', 'down')
_EXPERT_SLOTS = ('router', 'expert_gate', 'expert_up', 'expert_down')
_SHARED_SLOTS = ('shared_gate', 'shared_up', 'shared_down')


def layer_slots(cfg: ModelConfig, i: int) -> list[str]:
  """The slots layer i of our model of `cfg` has (QK-norm and biases only where switched on; the
  dense MLP's or the experts', with the shared experts' when there are any)."""
  mlp = _DENSE_SLOTS
  if cfg.is_moe_layer(i):
    mlp = (
      *_EXPERT_SLOTS,
      *(('router_bias',) if cfg.router == 'sigmoid_bias' else ()),
      *(_SHARED_SLOTS if cfg.shared_experts else ()),
    )
  every_mlp = (*_DENSE_SLOTS, *_EXPERT_SLOTS, 'router_bias', *_SHARED_SLOTS)
  return [
    s
    for s in SLOTS
    if (cfg.qk_norm or s not in QK_NORM_SLOTS)
    and (cfg.qkv_bias or s not in _BIAS_SLOTS)
    and (s in mlp or s not in every_mlp)
  ]


def model_slots(cfg: ModelConfig) -> list[str]:
  """The slots any layer of our model has (a mixed model's dense and MoE ones together)."""
  every = {s for i in range(cfg.num_layers) for s in layer_slots(cfg, i)}
  return [s for s in SLOTS if s in every]


def slot_path(cfg: ModelConfig, i: int, slot: str) -> tuple[tuple, int]:
  """(path of layer i's slot in our params, its index on the stack): the path's first key is the
  layer's run of one kind (ModelConfig.layer_runs; `blocks` when all layers are one kind)."""
  key, j = cfg.layer_location(i)
  return (key, *SLOTS[slot][0][1:]), j


def hf_shape(shape, layout):
  if layout == 'experts':  # each expert's tensor
    return (shape[2], shape[1])
  if layout == 'vector':
    return tuple(shape)
  if layout == 'bias':
    return (shape[0] * shape[1],)
  if layout == 'in_heads':
    return (shape[1] * shape[2], shape[0])
  if layout == 'heads_out':
    return (shape[2], shape[0] * shape[1])
  return (shape[1], shape[0])


def to_hf(array, layout):
  if layout == 'vector':
    return array
  if layout == 'bias':
    return array.reshape(-1)
  if layout == 'in_heads':
    return array.reshape(array.shape[0], -1).T
  if layout == 'heads_out':
    return array.reshape(-1, array.shape[-1]).T
  return array.T


def from_hf(tensor, layout, shape):
  if layout == 'vector':
    return tensor
  if layout == 'bias':
    return tensor.reshape(shape)
  return tensor.T.reshape(shape)


def layer_shapes(cfg: ModelConfig) -> dict:
  """Per-layer shape of each slot (our layout, without the layer axis)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  return dict(
    input_norm=(d,),
    q=(d, n, h),
    k=(d, k, h),
    v=(d, k, h),
    q_bias=(n, h),
    k_bias=(k, h),
    v_bias=(k, h),
    q_norm=(h,),
    k_norm=(h,),
    o=(n, h, d),
    post_attn_norm=(d,),
    gate=(d, f),
    up=(d, f),
    down=(f, d),
    router=(d, cfg.num_experts),
    router_bias=(cfg.num_experts,),
    expert_gate=(cfg.num_experts, d, cfg.expert_dim),
    expert_up=(cfg.num_experts, d, cfg.expert_dim),
    expert_down=(cfg.num_experts, cfg.expert_dim, d),
    shared_gate=(d, cfg.shared_experts * cfg.expert_dim),
    shared_up=(d, cfg.shared_experts * cfg.expert_dim),
    shared_down=(cfg.shared_experts * cfg.expert_dim, d),
  )


def layer_tensors(naming: Naming, cfg: ModelConfig, i: int, slot: str) -> list[tuple]:
  """(Hugging Face name, shape, expert index or None) of the tensors that hold layer i's slot:
  one, or one per expert."""
  layout = SLOTS[slot][1]
  shape = hf_shape(layer_shapes(cfg)[slot], layout)
  if layout == 'experts':
    return [(naming.layer_name(i, slot, e), shape, e) for e in range(cfg.num_experts)]
  return [(naming.layer_name(i, slot), shape, None)]


def get_at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def set_at(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
