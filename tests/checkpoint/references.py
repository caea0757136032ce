"""Float64 reference forwards written from the families' own modeling code (LLaDA's here), and
the tolerance our logits are held to against them: shared by the import, export and MoE tests."""

import math

import numpy as np
import pytest

torch = pytest.importorskip('torch')


def rms(x, w, eps):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(t_BNTH, theta, *, interleaved=False):
  """LLaDA's rotate-half RoPE; interleaved=True is the (wrong, GPT-J) pairing of the mutation."""
  hd, length = t_BNTH.shape[-1], t_BNTH.shape[-2]
  inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
  freqs = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
  if interleaved:
    cos, sin = freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)
    pairs = t_BNTH.unflatten(-1, (hd // 2, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
  else:
    angles = torch.cat((freqs, freqs), -1)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = t_BNTH[..., : hd // 2], t_BNTH[..., hd // 2 :]
    rotated = torch.cat((-x2, x1), -1)
  return t_BNTH * cos.to(t_BNTH.dtype) + rotated * sin.to(t_BNTH.dtype)


def llada_reference(sd, hf, ids, *, swap_gate_up=False, interleaved_rope=False, drop_bias=False):
  """LLaDA's forward (module docstring) in float64 from its state dict; the flags are the wrong
  details a broken import would compute instead."""
  sd = {k: v.double() for k, v in sd.items()}
  heads, kv, eps = hf['n_heads'], hf['n_kv_heads'], hf['rms_norm_eps']
  hd = hf['d_model'] // heads
  x = sd['model.transformer.wte.weight'][torch.as_tensor(ids)]
  batch, length, _ = x.shape

  def linear(h, name):
    out = h @ sd[name + '.weight'].T
    bias = sd.get(name + '.bias')
    return out if bias is None or drop_bias else out + bias

  for i in range(hf['n_layers']):
    p = f'model.transformer.blocks.{i}.'
    n = rms(x, sd[p + 'attn_norm.weight'], eps)
    q = linear(n, p + 'q_proj').view(batch, length, heads, hd).transpose(1, 2)
    k = linear(n, p + 'k_proj').view(batch, length, kv, hd).transpose(1, 2)
    v = linear(n, p + 'v_proj').view(batch, length, kv, hd).transpose(1, 2)
    q = rope(q, hf['rope_theta'], interleaved=interleaved_rope)
    k = rope(k, hf['rope_theta'], interleaved=interleaved_rope)
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v  # no mask
    x = x + linear(att.transpose(1, 2).reshape(batch, length, -1), p + 'attn_out')
    m = rms(x, sd[p + 'ff_norm.weight'], eps)
    gate, up = linear(m, p + 'ff_proj'), linear(m, p + 'up_proj')
    if swap_gate_up:
      gate, up = up, gate
    x = x + linear(torch.nn.functional.silu(gate) * up, p + 'ff_out')
  x = rms(x, sd['model.transformer.ln_f.weight'], eps)
  head = sd[
    'model.transformer.wte.weight' if hf['weight_tying'] else 'model.transformer.ff_out.weight'
  ]
  return (x @ head.T).numpy()


def assert_close(theirs, ours):
  """<= 1e-4 relative to the logits' scale (fp32 ours against the float64 reference)."""
  assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(theirs).max())
