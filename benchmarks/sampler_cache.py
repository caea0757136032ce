"""python -m benchmarks.sampler_cache [--tiny] [options]

Generated tokens/s of the sampler's K/V cache modes (none, prefix, dual; each with and without
the confidence threshold) beside a PyTorch implementation of the same algorithm in the same run:
a transformers Qwen3ForCausalLM of the model's shape with bidirectional attention, driven layer
by layer through a hand-written prefix / dual K/V cache loop (Fast-dLLM v1's generate_with_prefix_
cache / generate_with_dual_cache, batched), its layer torch.compile'd on GPU. Random weights, so
the threshold rarely fires (a trained model's confidence is what it buys). Before timing, both
sides check that a cached forward of an unchanged canvas gives the whole forward's logits.
One JSON line per measurement, one table last ('x none' and 'same as none' against the run's own
plain none row of the same length: no cache, no threshold, Fast-dLLM's baseline). The 'slices'
column: the attention of prefix / dual's cached slices, 'kernel' (model.attention_backend's
path: on GPU the in-place kernel, flash_attention_slice_cached, reading each layer's K/V from
the stacked cache), 'copy' (the path before it: each layer's cache gathered and the slice's
fresh K/V written into that copy, then the slice kernel flash_attention_slice) or 'xla' (the
dense XLA attention on those copies); --slice-attention both times kernel and copy side by
side, all the three. Each program is
compiled ahead (first_call_s) and then timed --repeats times. The GPU figures (docs/benchmarks.md,
Sampler), split to fit 10-minute commands:
  python -m benchmarks.sampler_cache --gen-lengths 256 --modes none,prefix,dual --repeats 1
  python -m benchmarks.sampler_cache --gen-lengths 512 --modes none --thresholds 0 --repeats 1
  python -m benchmarks.sampler_cache --gen-lengths 512 --modes prefix,dual --repeats 1
and Fast-dLLM's four rows (none, dual, threshold 0.9, both) at gen 256 and 512, dlmjax only:
  python -m benchmarks.sampler_cache --gen-lengths 256,512 --modes none,dual --thresholds 0,0.9 \
    --batch 16 --repeats 1 --no-torch
The in-place kernel against the copying slices it replaced (about 4 minutes on one H200):
  python -m benchmarks.sampler_cache --gen-lengths 256 --modes none,dual,prefix --thresholds 0 \
    --slice-attention both --repeats 1 --no-torch
The fused projections (q / k / v and gate / up one matmul each over weights concatenated once
per generate, the sampler's default) against the trained layout's three and two, side by side
in one process, the 8B decode at batch 1 ('step ms' is one sampler step; 'x unfused' and 'same
as unfused' are the fused row against the unfused row above it; docs/benchmarks.md, Sampler,
fused projections):
  python -m benchmarks.sampler_cache --preset llada_8b --batch 1 --gen-lengths 256 \
    --modes none,dual --thresholds 0 --fuse both --repeats 3 --no-torch
(defaults: the 1.7B of configs/pretrain_1p7b.py, batch 64, 64-token prompts, block 32).
On a CPU: python -m benchmarks.sampler_cache --tiny [--gen-lengths 256,512 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.diffusion import sampler_programs, sampling_config
from dlmjax.model import attention, presets

MODES = ('none', 'prefix', 'dual')
# make_generate_fn's fuse_projections for each --fuse
FUSE = {'on': (True,), 'off': (False,), 'both': (False, True)}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.sampler_cache',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--config', default='configs/pretrain_1p7b.py', help='model shape')
  parser.add_argument('--preset', default='', help='a model preset over the config, e.g. llada_8b')
  parser.add_argument('--tiny', action='store_true', help='a CPU-sized model and run')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--prompt-length', type=int, default=64)
  parser.add_argument('--gen-lengths', default=None, help='256,512 (--tiny: 32)')
  parser.add_argument('--block-length', type=int, default=32)
  parser.add_argument(
    '--thresholds', default='0,0.9', help='each mode runs at each (0 = off; Fast-dLLM: 0.9)'
  )
  parser.add_argument('--modes', default=','.join(MODES))
  parser.add_argument(
    '--slice-attention',
    default='kernel',
    help="prefix / dual's cached slices: kernel (the backend's: on GPU the kernel reading the "
    'stacked cache in place), copy (per-layer cache copies into the slice kernel, the path '
    'before it), xla (dense attention on the copies), both (kernel and copy) or all',
  )
  parser.add_argument(
    '--fuse',
    default='on',
    choices=tuple(FUSE),
    help="the sampler's fused q / k / v and gate / up projections: on (its default), off, or "
    'both (each variant unfused, then fused)',
  )
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--no-torch', action='store_true', help='dlmjax only')
  parser.add_argument(
    '--torch-compile', default='auto', choices=('auto', 'on', 'off'), help='auto: on GPU'
  )
  return parser


def _model_config(args):
  config = config_lib.load_file(args.config)
  if args.preset:
    presets.apply_preset(config.model, args.preset)
  if args.tiny:
    config.model.num_layers, config.model.d_model, config.model.ffn_dim = 2, 64, 128
    config.model.num_heads, config.model.num_kv_heads, config.model.head_dim = 4, 2, 16
    config.model.vocab_size, config.model.mask_token_id = 512, 3
    config.model.eos_token_id, config.model.pad_token_id = 2, 0
    config.model.dtype = 'float32'
  config.model.scan_layers = True  # one compiled layer: prefix unrolls its blocks.
  config.model.remat = 'none'
  if jax.default_backend() != 'gpu':
    config.model.attention_backend, config.model.norm_backend = 'xla', 'xla'
  elif config.model.attention_backend == 'cudnn':  # left padding is segment ids: cuDNN has none
    config.model.attention_backend = 'auto'  # (the sampler makes the same swap)
  return config, model_lib.ModelConfig.from_config(config)


# ---------------------------------------------------------------------------------------------
# dlmjax


def check_jax(model_config, params, prompt_BP, gen_length, block) -> float:
  """Max |logit difference| of the dual and prefix slices against the whole forward."""
  batch, width = prompt_BP.shape
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(
    np.concatenate([prompt_BP, rng.integers(4, 100, (batch, gen_length))], 1), jnp.int32
  )
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  segments = jnp.ones_like(tokens)
  start = width + block

  @jax.jit
  def run(params):
    module = model_lib.merge(model_config, params)
    hidden, kv = module.hidden_kv(tokens, positions_BL=positions, segment_ids_BL=segments)
    full = module.logits(hidden)
    worst = []
    for size in (block, tokens.shape[1] - start):
      sl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)  # noqa: E731,B023
      got, _ = module.hidden_kv(
        sl(tokens),
        positions_BL=sl(positions),
        segment_ids_BL=segments,
        kv_cache=kv,
        cache_start=start,
      )
      worst.append(jnp.max(jnp.abs(module.logits(got) - sl(full))))
    return jnp.max(jnp.stack(worst)), jnp.max(jnp.abs(full))

  diff, scale = (float(a) for a in run(params))
  return diff / max(scale, 1e-6)


SLICE_PATHS = ('kernel', 'copy', 'xla')


@contextlib.contextmanager
def slice_path(path: str):
  """Cached slices through `path`: 'kernel' (attention.cached_slice_attention as it is: on GPU
  the in-place kernel), 'copy' (attention.gathered_slice_attention: a copy of each layer's cache
  with the fresh K/V written in, into slice_attention: the slice kernel on GPU) or 'xla' (those
  copies into xla_attention, the path before the slice kernel). Compiled programs are cached
  per setting, not per path: the cache is cleared on the way in and out."""
  if path not in SLICE_PATHS:
    raise ValueError(f'unknown slice path {path!r}; known: {SLICE_PATHS}')
  sampler_programs.make_generate_fn.cache_clear()
  original = attention.cached_slice_attention, attention.slice_attention
  if path in ('copy', 'xla'):
    attention.cached_slice_attention = attention.gathered_slice_attention
  if path == 'xla':

    def dense(q, k, v, *, backend, **mask):
      del backend
      return attention.xla_attention(q, k, v, **mask)

    attention.slice_attention = dense
  try:
    yield
  finally:
    attention.cached_slice_attention, attention.slice_attention = original
    sampler_programs.make_generate_fn.cache_clear()


def time_jax(config, model_config, params, sampling, prompt_BP, repeats, fuse=True) -> dict:
  m = config.model
  fn = sampler_programs.make_generate_fn(
    model_config,
    sampling,
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
    fuse_projections=fuse,
  )
  lengths_B = np.full(prompt_BP.shape[0], prompt_BP.shape[1], np.int32)
  start = time.perf_counter()  # compiled ahead, so no untimed run is needed.
  fn = fn.lower(params, prompt_BP, lengths_B, jax.random.key(0)).compile()
  first = time.perf_counter() - start
  best, out = math.inf, None
  for i in range(max(repeats, 1)):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(params, prompt_BP, lengths_B, jax.random.key(i)))
    best = min(best, time.perf_counter() - start)
  tokens = prompt_BP.shape[0] * sampling.gen_length
  return dict(
    tokens_per_s=tokens / best,
    seconds=best,
    step_ms=best / sampling.steps * 1e3,
    first_call_s=first,
    out=np.asarray(out),
  )


# ---------------------------------------------------------------------------------------------
# PyTorch: the same algorithm, written for this benchmark.


class TorchPeer:
  """A transformers Qwen3 of the model's shape, run layer by layer with bidirectional attention
  and a K/V cache [layers] x ([B, K, S, H], [B, K, S, H]) written in place (Fast-dLLM's
  replace_position)."""

  def __init__(self, model_config, device, compile_layer: bool):
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import Qwen3Config, Qwen3ForCausalLM  # pylint: disable=import-outside-toplevel

    c = model_config
    self.torch, self.device, self.cfg = torch, device, c
    hf = Qwen3Config(
      vocab_size=c.vocab_size,
      hidden_size=c.d_model,
      intermediate_size=c.ffn_dim,
      num_hidden_layers=c.num_layers,
      num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads,
      head_dim=c.head_dim,
      max_position_embeddings=c.seq_len,
      rms_norm_eps=c.norm_eps,
      rope_theta=c.rope_theta,
      tie_word_embeddings=c.tie_embeddings,
      attention_bias=False,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if c.compute_dtype == jnp.bfloat16 else torch.float32
    self.model = Qwen3ForCausalLM(hf).to(device=device, dtype=dtype).eval()
    body = self.model.model
    self.weights = [
      (
        lay.input_layernorm.weight,
        lay.self_attn.q_proj.weight,
        lay.self_attn.k_proj.weight,
        lay.self_attn.v_proj.weight,
        lay.self_attn.q_norm.weight,
        lay.self_attn.k_norm.weight,
        lay.self_attn.o_proj.weight,
        lay.post_attention_layernorm.weight,
        lay.mlp.gate_proj.weight,
        lay.mlp.up_proj.weight,
        lay.mlp.down_proj.weight,
      )
      for lay in body.layers
    ]
    for name in ('cache_size_limit', 'recompile_limit'):  # prefix: one shape per block.
      if hasattr(torch._dynamo.config, name):
        setattr(torch._dynamo.config, name, 256)
    self.layer = torch.compile(self._layer, dynamic=False) if compile_layer else self._layer
    inv = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim)
    self.inv_freq = inv

  def _layer(self, x, w, cos, sin, cache_k, cache_v, index):
    """One pre-norm Qwen3 layer over x [B, Q, D]; with a cache its fresh K/V go in at `index`."""
    torch, c = self.torch, self.cfg
    F = torch.nn.functional
    ln1, wq, wk, wv, qn, kn, wo, ln2, wg, wu, wd = w
    b, q_len, _ = x.shape

    def norm(t, scale):
      t32 = t.float()
      return scale * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + c.norm_eps)).to(t.dtype)

    def rope(t):  # [B, heads, Q, H], rotate-half
      t1, t2 = t.float().chunk(2, dim=-1)
      return (t.float() * cos + torch.cat([-t2, t1], -1) * sin).to(t.dtype)

    h = norm(x, ln1)
    q = norm(F.linear(h, wq).view(b, q_len, c.num_heads, c.head_dim), qn).transpose(1, 2)
    k = norm(F.linear(h, wk).view(b, q_len, c.num_kv_heads, c.head_dim), kn).transpose(1, 2)
    v = F.linear(h, wv).view(b, q_len, c.num_kv_heads, c.head_dim).transpose(1, 2)
    q, k = rope(q), rope(k)
    if cache_k is not None:
      cache_k.index_copy_(2, index, k)
      cache_v.index_copy_(2, index, v)
      k, v = cache_k, cache_v
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=c.num_heads != c.num_kv_heads)
    x = x + F.linear(out.transpose(1, 2).reshape(b, q_len, -1), wo)
    h = norm(x, ln2)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd), k, v

  def forward(self, ids, start, cache=None, rows=None):
    """(float32 logits of ids' rows [rows[0], rows[1]) (all by default), the K/V of every
    layer) of ids = canvas[start:start + Q]; the head runs on those rows only, as dlmjax's."""
    torch = self.torch
    q_len = ids.shape[1]
    index = torch.arange(start, start + q_len, device=self.device)
    angles = index.float()[:, None] * self.inv_freq[None]
    cos, sin = (torch.cat([t, t], -1)[None, None] for t in (angles.cos(), angles.sin()))
    x = self.model.model.embed_tokens(ids)
    kv = []
    for i, w in enumerate(self.weights):
      ck, cv = (None, None) if cache is None else cache[i]
      x, k, v = self.layer(x, w, cos, sin, ck, cv, index)
      kv.append((k, v))
    if rows is not None:
      x = x[:, rows[0] : rows[1]]
    return self.model.lm_head(self.model.model.norm(x)).float(), kv

  def generate(self, prompt, s: sampling_config.SamplingConfig, mask_id, vocab_size):
    """The batched Fast-dLLM loop, greedy, low-confidence remasking; tokens [B, P + gen]."""
    torch = self.torch
    b, width = prompt.shape
    length = width + s.gen_length
    x = torch.full((b, length), mask_id, dtype=torch.long, device=self.device)
    x[:, :width] = prompt
    spb, block = s.steps_per_block, s.block_length
    banned = torch.arange(self.cfg.vocab_size, device=self.device)
    banned = (banned >= vocab_size) | (banned == mask_id)
    for nb in range(s.num_blocks):
      lo, hi = width + nb * block, width + (nb + 1) * block
      masked = x[:, lo:hi] == mask_id
      n = masked.sum(1, keepdim=True)
      counts = n // spb + (torch.arange(spb, device=self.device)[None] < n % spb)
      cache = None
      for step in range(spb):
        if s.cache == 'none' or step == 0:
          logits, kv = self.forward(x, 0, rows=(lo, hi))
          cache = kv  # prefix overwrites [lo, end) of it, dual [lo, hi), every later step.
        elif s.cache == 'dual':
          logits = self.forward(x[:, lo:hi], lo, cache)[0]
        else:
          logits = self.forward(x[:, lo:], lo, cache, rows=(0, block))[0]
        logits = logits.masked_fill(banned, -math.inf)
        x0 = logits.argmax(-1)
        conf = torch.softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
        blk = x[:, lo:hi]
        masked = blk == mask_id
        conf = torch.where(masked, conf, -math.inf)
        rank = torch.argsort(torch.argsort(conf, dim=-1, descending=True, stable=True), dim=-1)
        commit = masked & (rank < counts[:, step : step + 1])
        if s.threshold > 0:
          commit |= masked & (conf >= s.threshold)
        x[:, lo:hi] = torch.where(commit, x0, blk)
        if s.threshold > 0 and not (x[:, lo:hi] == mask_id).any():
          break
    return x

  def check(self, prompt, gen_length, block) -> float:
    """Relative max |logit difference| of the dual and prefix slices against the whole forward."""
    torch = self.torch
    with torch.no_grad():
      g = torch.Generator(device='cpu').manual_seed(1)
      tail = torch.randint(4, 100, (prompt.shape[0], gen_length), generator=g).to(self.device)
      x = torch.cat([prompt, tail], 1)
      start = prompt.shape[1] + block
      full, kv = self.forward(x, 0)
      worst = 0.0
      for end in (start + block, x.shape[1]):
        cache = [(k.clone(), v.clone()) for k, v in kv]
        got = self.forward(x[:, start:end], start, cache)[0]
        worst = max(worst, float((got - full[:, start:end]).abs().max()))
      return worst / max(float(full.abs().max()), 1e-6)

  def time(self, prompt, s, mask_id, vocab_size, repeats) -> dict:
    torch = self.torch
    sync = torch.cuda.synchronize if self.device == 'cuda' else (lambda: None)
    with torch.no_grad():
      start = time.perf_counter()
      out = self.generate(prompt, s, mask_id, vocab_size)  # compiles every shape once
      sync()
      first = time.perf_counter() - start
      best = math.inf
      for _ in range(repeats):
        start = time.perf_counter()
        self.generate(prompt, s, mask_id, vocab_size)
        sync()
        best = min(best, time.perf_counter() - start)
    tokens = prompt.shape[0] * s.gen_length
    return dict(tokens_per_s=tokens / best, seconds=best, first_call_s=first, out=out.cpu().numpy())


# ---------------------------------------------------------------------------------------------


def _table(rows) -> str:
  head = (
    'gen',
    'mode',
    'slices',
    'threshold',
    'fused',
    'step ms',
    'dlmjax tok/s',
    'x none',
    'x unfused',
    'same as unfused',
    'torch tok/s',
    'x none',
    'dlmjax/torch',
    'same as none',
  )
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    lines.append(
      ' | '.join(
        str(v)
        for v in (
          r['gen'],
          r['mode'],
          r['slices'],
          r['threshold'],
          r['fused'],
          r['jax_step_ms'],
          r['jax_tokens_per_s'],
          r.get('jax_vs_none', '-'),
          r.get('jax_vs_unfused', '-'),
          f'{r["same_as_unfused"]:.0%}' if 'same_as_unfused' in r else '-',
          r.get('torch_tokens_per_s', '-'),
          r.get('torch_vs_none', '-'),
          r.get('jax_vs_torch', '-'),
          f'{r["same_as_none"]:.0%}' if 'same_as_none' in r else '-',
        )
      )
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.tiny:
    args.batch, args.prompt_length = min(args.batch, 4), min(args.prompt_length, 8)
    args.gen_lengths, args.block_length = args.gen_lengths or '32', 8
    args.repeats = 1
  args.gen_lengths = args.gen_lengths or '256,512'
  try:
    modes = [m.strip() for m in args.modes.split(',') if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
      raise ValueError(f'unknown modes {sorted(unknown)}; known: {list(MODES)}.')
    paths = {'both': ['kernel', 'copy'], 'all': list(SLICE_PATHS)}.get(
      args.slice_attention, [args.slice_attention]
    )
    if set(paths) - set(SLICE_PATHS):
      raise ValueError(
        f'--slice-attention {args.slice_attention!r}: kernel, copy, xla, both or all.'
      )
    gens = [int(g) for g in args.gen_lengths.split(',')]
    fuses = FUSE[args.fuse]
    thresholds = [float(t) for t in args.thresholds.split(',')]
    config, model_config = _model_config(args)
    if model_config.attention_mask != 'bidirectional':
      raise ValueError(
        f'{args.config} is {model_config.attention_mask}; prefix / dual are for '
        'bidirectional models (a causal one takes the exact cache=block).'
      )
    for gen in gens:
      sampling_config.SamplingConfig(
        gen_length=gen, steps=gen, block_length=args.block_length
      ).validate()
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  m = config.model
  params = jax.jit(model_lib.init_params, static_argnums=0)(model_config, jax.random.key(0))
  rng = np.random.default_rng(0)
  special = {m.mask_token_id, m.eos_token_id, m.pad_token_id}
  choices = np.array([t for t in range(min(m.vocab_size, 1000)) if t not in special])
  prompt_BP = rng.choice(choices, (args.batch, args.prompt_length)).astype(np.int32)
  device = jax.devices()[0].device_kind
  peer = None
  if not args.no_torch:
    import torch  # pylint: disable=import-outside-toplevel

    torch_device = 'cuda' if torch.cuda.is_available() else 'cpu'
    compile_layer = args.torch_compile == 'on' or (
      args.torch_compile == 'auto' and torch_device == 'cuda'
    )
    peer = TorchPeer(model_config, torch_device, compile_layer)
    prompt_torch = torch.as_tensor(prompt_BP, dtype=torch.long, device=torch_device)
  checks = dict(jax=check_jax(model_config, params, prompt_BP, gens[0], args.block_length))
  if peer:
    checks['torch'] = peer.check(prompt_torch, gens[0], args.block_length)
  # bf16 on GPU: the slice and the whole canvas run different kernels (1.7B, XLA slices: 0.04).
  tolerance = 0.1 if model_config.compute_dtype == jnp.bfloat16 else 1e-4
  print(json.dumps(dict(check='cached slice vs whole forward, relative max |dlogit|', **checks)))
  if max(checks.values()) > tolerance:
    print(f'error: a cached forward differs from the whole forward: {checks}', file=sys.stderr)
    return 1
  rows = []
  for gen in gens:
    plain = sampling_config.SamplingConfig(
      gen_length=gen, steps=gen, block_length=args.block_length
    )
    base = {}
    variants = [
      (mode, threshold, path, fuse)
      for mode in modes
      for threshold in thresholds
      for path in (paths if mode != 'none' else paths[:1])  # none has no slices
      for fuse in fuses
    ]
    for mode, threshold, path, fuse in variants:
      s = dataclasses.replace(plain, cache=mode, threshold=threshold)
      with slice_path(path):
        jx = time_jax(config, model_config, params, s, prompt_BP, args.repeats, fuse)
      slices = '-' if mode == 'none' else path
      row = dict(gen=gen, mode=mode, slices=slices, threshold=threshold, device=device)
      row['batch'] = args.batch
      row.update(prompt=args.prompt_length, block=args.block_length, steps=gen)
      row['fused'] = 'on' if fuse else 'off'
      row['jax_step_ms'] = round(jx['step_ms'], 2)
      row['jax_tokens_per_s'] = round(jx['tokens_per_s'], 1)
      row['jax_first_call_s'] = round(jx['first_call_s'], 1)
      if mode == 'none':
        base[('jax', threshold, fuse)] = jx
      first = base.setdefault((mode, threshold, fuse), jx)  # the first slice path's tokens
      if first is not jx:  # the paths differ by rounding only (in bf16 it may flip tokens)
        row['same_as_' + paths[0]] = float(np.mean(jx['out'] == first['out']))
      unfused = base.get((mode, threshold, path, False))
      if fuse and unfused:  # one matmul grouping against another: in bf16 it may flip tokens
        row['jax_vs_unfused'] = round(jx['tokens_per_s'] / unfused['tokens_per_s'], 2)
        row['same_as_unfused'] = float(np.mean(jx['out'] == unfused['out']))
      if not fuse:
        base[(mode, threshold, path, False)] = jx
      ref = base.get(('jax', 0.0, fuse), base.get(('jax', threshold, fuse)))
      if ref:
        row['jax_vs_none'] = round(jx['tokens_per_s'] / ref['tokens_per_s'], 2)
        row['same_as_none'] = float(np.mean(jx['out'] == ref['out']))
      if peer and path == paths[0] and fuse == fuses[0]:
        pt = peer.time(prompt_torch, s, m.mask_token_id, m.vocab_size, args.repeats)
        if mode == 'none':
          base[('torch', threshold)] = pt
        row['torch_tokens_per_s'] = round(pt['tokens_per_s'], 1)
        row['torch_first_call_s'] = round(pt['first_call_s'], 1)
        ref = base.get(('torch', 0.0), base.get(('torch', threshold)))
        if ref:
          row['torch_vs_none'] = round(pt['tokens_per_s'] / ref['tokens_per_s'], 2)
        row['jax_vs_torch'] = round(jx['tokens_per_s'] / pt['tokens_per_s'], 2)
      print(json.dumps(row), flush=True)
      rows.append(row)
  print(_table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
