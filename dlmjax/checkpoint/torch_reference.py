"""PyTorch forwards of an exported checkpoint, for parity checks against our JAX model.

Two of them: transformers' own class of the export's family (Qwen3ForCausalLM, Qwen2ForCausalLM or
LlamaForCausalLM, by config.json's model_type) with our attention mask kind, through the
modeling file exports ship (hf_modeling/modeling_dlmjax.py), and `Reference`, a small module written
here from the same equations, for machines without transformers. Both read the exported names
(Qwen3's, or Qwen2's / Llama's / Dream's: no q/k norm weights, and q/k/v biases where present;
Dream's logits shifted right by one, as its generate reads them). A family whose classes are remote
code not here (Family.parity 'reference': Dream, SDAR) is checked against `Reference`, with the
family's mask where config.json names none (SDAR's block-causal over its block_size).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from dlmjax.checkpoint import families
from dlmjax.checkpoint import hf_config


def visibility(length: int, kind: str, block_size: int = 0, device=None) -> torch.Tensor | None:
  """Boolean [L, L] (query, key) visibility, or None for full bidirectional attention."""
  if kind == 'bidirectional':
    return None
  q = torch.arange(length, device=device)[:, None]
  k = torch.arange(length, device=device)[None, :]
  if kind == 'causal':
    return q >= k
  if kind == 'block_causal':
    return (q // block_size) >= (k // block_size)
  raise ValueError(f'unknown attention mask kind {kind!r}')


def transformers_model(hf_dir: str, dtype: torch.dtype = torch.float32):
  """transformers' class of the directory's family attending with its mask kind: dlmjax's
  modeling_dlmjax.py (the one file every export ships and this package holds), loaded the way
  the README tells users for an export (AutoModelForCausalLM with trust_remote_code, through
  config.json's auto_map), else by model_type for a directory without it (transformers' own
  Qwen3 / Qwen2 / Llama save_pretrained: bidirectional, as config.json names no mask kind)."""
  import transformers  # pylint: disable=import-outside-toplevel

  transformers.utils.logging.disable_progress_bar()
  if os.path.exists(os.path.join(hf_dir, hf_config.MODELING_FILE)):
    model = transformers.AutoModelForCausalLM.from_pretrained(
      hf_dir, dtype=dtype, trust_remote_code=True
    )
  else:
    from dlmjax.checkpoint.hf_modeling import modeling_dlmjax  # pylint: disable=import-outside-toplevel

    hf = hf_config.read(hf_dir)
    if families.detect(hf).in_transformers:  # transformers' own class; config.json's is_causal
      return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    model_type = hf.get('model_type')
    if model_type not in modeling_dlmjax.CLASSES:
      raise hf_config.HFConfigError(
        f'{hf_dir}: model_type={model_type!r} has no transformers class here; '
        f'known: {", ".join(modeling_dlmjax.CLASSES)}.'
      )
    model = modeling_dlmjax.CLASSES[model_type].from_pretrained(hf_dir, dtype=dtype)
  return model.eval()


def _rms_norm(x, weight, eps):
  x32 = x.float()
  return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x_BNLH, theta):
  """Rotate-half RoPE computed in float32, as dlmjax.model.layers.rotary_embedding."""
  length, head_dim = x_BNLH.shape[-2:]
  device = x_BNLH.device
  inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
  angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq
  angles = torch.cat([angles, angles], dim=-1)
  x = x_BNLH.float()
  x1, x2 = x.chunk(2, dim=-1)
  return (x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()).to(x_BNLH.dtype)


class Reference(torch.nn.Module):
  """Our transformer in plain PyTorch over an exported state dict (weights [out, in]): Qwen3's
  names, or Qwen2's / Llama's (no q_norm / k_norm: q and k go straight to RoPE; q/k/v biases
  added where the state dict has them)."""

  def __init__(
    self, hf_config: dict, state_dict: dict, dtype: torch.dtype = torch.float32, device='cpu'
  ):
    super().__init__()
    kind = (hf_config.get('rope_parameters') or hf_config.get('rope_scaling') or {}).get(
      'rope_type', 'default'
    )
    if kind != 'default':
      raise ValueError(
        f'the plain PyTorch reference has no {kind!r} RoPE scaling; compare with transformers '
        '(verify --backend transformers).'
      )
    self.c = hf_config
    self.w = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if hf_config['tie_word_embeddings']:
      self.w['lm_head.weight'] = self.w['model.embed_tokens.weight']

  def _attention(self, x, i, mask):
    c, w = self.c, self.w
    p = f'model.layers.{i}.self_attn.'
    batch, length, _ = x.shape
    eps = c['rms_norm_eps']
    h = c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']  # Dream has no head_dim.

    def heads(name, count):
      y = F.linear(x, w[p + name + '.weight'], w.get(p + name + '.bias'))
      return y.view(batch, length, count, h).transpose(1, 2)

    def norm(y, name):
      return _rms_norm(y, w[p + name + '.weight'], eps) if p + name + '.weight' in w else y

    q = _rope(norm(heads('q_proj', c['num_attention_heads']), 'q_norm'), c['rope_theta'])
    k = _rope(norm(heads('k_proj', c['num_key_value_heads']), 'k_norm'), c['rope_theta'])
    v = heads('v_proj', c['num_key_value_heads'])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum('bnqh,bnkh->bnqk', q.float(), k.float()) / math.sqrt(h)
    if mask is not None:
      logits = logits.masked_fill(~mask, -1e30)
    probs = logits.softmax(-1).to(v.dtype)
    out = torch.einsum('bnqk,bnkh->bqnh', probs, v).reshape(batch, length, -1)
    return F.linear(out, w[p + 'o_proj.weight'])

  @torch.no_grad()
  def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, L, vocab rows of the export]."""
    c, w = self.c, self.w
    eps = c['rms_norm_eps']
    family = families.detect(c)  # a config.json without attn_mask_type: its family's mask
    mask = visibility(
      tokens_BL.shape[1],
      c.get('attn_mask_type') or family.reference_mask,
      c.get('block_size', 0),
      tokens_BL.device,
    )
    x = w['model.embed_tokens.weight'][tokens_BL]
    for i in range(c['num_hidden_layers']):
      p = f'model.layers.{i}.'
      x = x + self._attention(_rms_norm(x, w[p + 'input_layernorm.weight'], eps), i, mask)
      h = _rms_norm(x, w[p + 'post_attention_layernorm.weight'], eps)
      gate = F.linear(h, w[p + 'mlp.gate_proj.weight'])
      up = F.linear(h, w[p + 'mlp.up_proj.weight'])
      x = x + F.linear(F.silu(gate) * up, w[p + 'mlp.down_proj.weight'])
    x = _rms_norm(x, w['model.norm.weight'], eps)
    logits = F.linear(x.float(), w['lm_head.weight'].float())  # fp32 products, as our head.
    if family.reference_shift:  # token i read from position i-1 (Dream).
      logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits
