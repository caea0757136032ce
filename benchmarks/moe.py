"""python -m benchmarks.moe [--tiny] [--layers 4] [--micro-batch 8] [--seq 2048] [--no-peer]
  [--backend auto|xla|tokamax|pallas]

MoE on one GPU, three measurements and one table last:
1. The grouped matmul of dispatch (kernels/grouped_matmul.py): 64 experts, 131,072 token
   assignments (16,384 tokens x top-8), 2048 -> 1408, bf16, forward and forward+backward, for
   every backend that runs here (XLA's ragged_dot; our Pallas kernels; tokamax's Mosaic GPU
   ragged_dot where it imports), in TFLOP/s beside a dense [131072, 2048] x [2048, 1408] matmul of
   the same FLOPs. Each backend's output is checked against XLA's (relative L2 error); a backend
   that fails prints its error and leaves NaN in its row. benchmarks/grouped_matmul.py measures
   the backends at both MoE presets' shapes, gradients checked too.
2. The MoE train step of the real trainer (dlmjax.bench.run), its grouped matmul --backend
   (model.moe.backend; auto: tokamax on GPU where it imports, else XLA): the LLaDA-MoE-7B-A1B
   shape (2048 wide, 64 experts of 1024, top-8, vocab 157184) with --layers of its 16 layers to
   fit one GPU, bf16, masked diffusion; tokens/s and MFU on active FLOPs
   (ModelConfig.flops_per_token: the experts a token runs through, not all of them).
3. The PyTorch peer: transformers' Qwen3MoeForCausalLM at the same shape (raw top-k weights as
   LLaDA-MoE: norm_topk_prob off), bidirectional SDPA, fused grouped_mm experts, bf16 autocast
   over float32 weights, fused AdamW, torch.compile; the same masked-diffusion loss and the same
   FLOPs per token for its MFU. It runs first and frees its memory before JAX allocates.

On the H200 (well under 5 minutes):
    python -m benchmarks.moe --backend pallas
    python -m benchmarks.moe --backend pallas --preset llada2_mini   # LLaDA2.0-mini's shape
On CPU, the same code at toy sizes (no torch.compile, float32 peer):
    python -m benchmarks.moe --tiny
"""

from __future__ import annotations

import os

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # the peer runs first: see above

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from dlmjax import bench  # noqa: E402
from dlmjax import config as config_lib  # noqa: E402
from dlmjax import model as model_lib  # noqa: E402
from dlmjax.kernels import grouped_matmul as gmm  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), '..')
FULL_GMM = dict(experts=64, rows=131072, k=2048, n=1408)
TINY_GMM = dict(experts=4, rows=256, k=64, n=96)


def _group_sizes(key, experts, rows):
  """Uneven, as a router makes them: multinomial counts of a Dirichlet-ish share per expert."""
  share = jax.random.uniform(key, (experts,), minval=0.5, maxval=1.5)
  counts = np.floor(np.asarray(share / share.sum()) * rows).astype(np.int32)
  counts[0] += rows - counts.sum()
  return jnp.asarray(counts)


def grouped_matmul_rows(shape, iters):
  """[(name, ms, TFLOP/s, rel err)] for each backend, forward and forward+backward, and dense."""
  e, m, k, n = shape['experts'], shape['rows'], shape['k'], shape['n']
  keys = jax.random.split(jax.random.key(0), 4)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  sizes = _group_sizes(keys[2], e, m)
  cot = jax.random.normal(keys[3], (m, n), jnp.bfloat16)
  flops = 2 * m * k * n
  backends = ['xla', 'pallas'] + (['tokamax'] if gmm.tokamax_available() else [])
  rows, reference = [], None
  for backend in backends:

    def fwd(a, b, s, backend=backend):
      return gmm.grouped_matmul(a, b, s, backend=backend)

    def fwd_bwd(a, b, s, g, backend=backend):
      out, vjp = jax.vjp(lambda a, b: fwd(a, b, s), a, b)
      return (out, *vjp(g))

    ms, err = float('nan'), float('nan')
    try:  # a backend that fails (tokamax built for another jax) leaves NaN in its rows
      out = jax.jit(fwd)(lhs, rhs, sizes)
      if backend == 'xla':
        reference, err = out, 0.0
      elif reference is not None:
        err = timing.rel_err(out, reference)
      ms = timing.median_ms(fwd, (lhs, rhs, sizes), iters)
    except Exception as e:  # noqa: BLE001
      print(f'grouped matmul fwd, {backend}: {str(e).splitlines()[0][:160]}', flush=True)
    rows.append((f'grouped matmul fwd, {backend}', ms, flops / ms / 1e9, err))
    try:  # XLA's ragged_dot backward materialises per-group buffers: 64 GiB at FULL_GMM
      ms = timing.median_ms(fwd_bwd, (lhs, rhs, sizes, cot), iters)
    except Exception as e:  # noqa: BLE001
      print(f'grouped matmul fwd+bwd, {backend}: {str(e).splitlines()[0][:160]}', flush=True)
      ms = float('nan')
    rows.append((f'grouped matmul fwd+bwd, {backend}', ms, 3 * flops / ms / 1e9, err))
  dense_rhs = rhs[0]
  ms = timing.median_ms(lambda a, b: a @ b, (lhs, dense_rhs), iters)
  rows.append(('dense matmul (same FLOPs)', ms, flops / ms / 1e9, float('nan')))
  return rows


def moe_config(args):
  c = config_lib.load_file(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'))
  if args.tiny:
    model_lib.apply_preset(c.model, 'tiny_moe')
    c.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=4, head_dim=16)
    c.model.update(vocab_size=512, seq_len=args.seq, dtype='float32')
    c.model.moe.ffn_dim = 32
    c.model.update(mask_token_id=3, eos_token_id=2, pad_token_id=0, remat='none')
  else:
    model_lib.apply_preset(c.model, args.preset)
    c.model.update(num_layers=args.layers, seq_len=args.seq, dtype='bfloat16')
  c.model.attention_backend = 'xla' if args.tiny else 'auto'
  c.model.moe.backend = args.backend
  c.train.update(global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch)
  c.model.moe.update(balance_loss=0.0, z_loss=0.0)
  c.train.check_memory = False
  c.mesh.fsdp = 1
  c.data.source = 'builtin'
  return c


def torch_peer(config, args):
  """(tokens/s, last loss, peak GiB) of transformers' Qwen3-MoE at the config's shape."""
  import torch  # noqa: PLC0415 - the `torch` extra
  import torch.nn.functional as F  # noqa: PLC0415
  from transformers import AttentionInterface, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: PLC0415

  def bidirectional_sdpa(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):
    del module, attention_mask, dropout, kw
    if k.shape[1] != q.shape[1]:  # GQA: repeat the K/V heads
      k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
      v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=scaling)
    return out.transpose(1, 2).contiguous(), None

  AttentionInterface.register('bidir_sdpa', bidirectional_sdpa)
  m = config.model
  gpu = torch.cuda.is_available()
  device = 'cuda' if gpu else 'cpu'
  peer_cfg = Qwen3MoeConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    intermediate_size=m.ffn_dim,
    moe_intermediate_size=m.moe.ffn_dim,
    num_experts=m.moe.num_experts,
    num_experts_per_tok=m.moe.experts_per_token,
    norm_topk_prob=m.moe.router == 'softmax_topk',
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    max_position_embeddings=max(m.seq_len, 4096),
    rms_norm_eps=m.norm_eps,
    rope_parameters={'rope_type': 'default', 'rope_theta': m.rope_theta},
    tie_word_embeddings=False,
    experts_implementation='grouped_mm' if gpu else 'eager',
  )
  peer_cfg._attn_implementation = 'bidir_sdpa'
  torch.manual_seed(0)
  model = Qwen3MoeForCausalLM(peer_cfg).to(device)
  opt = torch.optim.AdamW(
    model.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu
  )
  mask_id, batch, seq = m.mask_token_id, config.train.micro_batch_size, m.seq_len
  token_range = (mask_id + 1, m.vocab_size) if mask_id < 4 else (0, mask_id)  # never the mask

  def loss_fn(x):
    b, length = x.shape
    t = torch.rand(b, 1, device=x.device)
    masked = torch.rand(b, length, device=x.device) < t
    masked[:, 0] |= ~masked.any(1)
    p = masked.float().mean(1, keepdim=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
      logits = model(input_ids=torch.where(masked, mask_id, x)).logits
    ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), x.view(-1), reduction='none')
    return (ce.view(b, length) * masked / p).sum() / (b * length)

  step_loss = torch.compile(loss_fn) if gpu else loss_fn

  def step():
    x = torch.randint(*token_range, (batch, seq), device=device)
    loss = step_loss(x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  for _ in range(2):
    step()
  sync = torch.cuda.synchronize if gpu else (lambda: None)
  sync()
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step()
  sync()
  step_s = (time.perf_counter() - start) / args.steps
  peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float('nan')
  return batch * seq / step_s, float(loss), peak


def _free_torch():
  """The peer's memory back to the device before JAX allocates (its model is out of scope)."""
  gc.collect()
  import torch  # noqa: PLC0415

  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tiny', action='store_true', help='toy sizes that run on CPU')
  parser.add_argument('--layers', type=int, default=4, help="of LLaDA-MoE's 16 layers")
  parser.add_argument('--micro-batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--steps', type=int, default=5, help='timed train steps')
  parser.add_argument('--no-peer', action='store_true', help='skip the PyTorch peer')
  parser.add_argument(
    '--preset',
    default='llada_moe_7b_a1b',
    choices=('llada_moe_7b_a1b', 'llada2_mini'),
    help='the MoE shape (llada2_mini: grouped sigmoid routing, layer 0 dense, a shared expert; '
    'its peer would be another router, so it runs without one)',
  )
  parser.add_argument(
    '--backend', default='auto', choices=gmm.BACKENDS, help="the train step's model.moe.backend"
  )
  args = parser.parse_args(argv)
  args.no_peer = args.no_peer or args.preset == 'llada2_mini'
  if args.tiny:
    args.seq, args.micro_batch, args.steps = min(args.seq, 32), min(args.micro_batch, 2), 2

  config = moe_config(args)
  cfg = model_lib.ModelConfig.from_config(config)
  flops_per_token = cfg.flops_per_token()
  from dlmjax.train import reporting  # noqa: PLC0415

  peak = reporting.peak_flops_per_device(0.0)
  mfu = (lambda tps: tps * flops_per_token / peak) if peak else (lambda tps: float('nan'))
  table = []
  if not args.no_peer:
    try:
      peer_tps, peer_loss, peer_mem = torch_peer(config, args)
      _free_torch()
      table.append(('train step, transformers Qwen3-MoE peer', peer_tps, mfu(peer_tps), peer_mem))
      print(f'peer: loss {peer_loss:.3f}, {peer_tps:,.0f} tokens/s', flush=True)
    except ImportError as e:  # the `torch` extra missing
      print(f'peer skipped: {e}')

  gmm_rows = grouped_matmul_rows(TINY_GMM if args.tiny else FULL_GMM, 2 if args.tiny else 20)
  for name, ms, tflops, err in gmm_rows:
    print(f'{name}: {ms:.3f} ms, {tflops:.1f} TFLOP/s, rel err {err:.2e}', flush=True)

  result = bench.run(config, steps=args.steps, warmup=1, matmul=False)
  ours_tps = result['tokens_per_s']
  table.append(
    (
      f'train step, dlmjax ({args.backend})',
      ours_tps,
      mfu(ours_tps),
      result.get('peak_mem_gib', np.nan),
    )
  )

  shape = TINY_GMM if args.tiny else FULL_GMM
  print(
    f'\nMoE on {jax.devices()[0].device_kind}: grouped matmul {shape}; train step '
    f'{cfg.num_layers} layers x {cfg.num_experts} experts (top-{cfg.experts_per_token}, width '
    f'{cfg.expert_dim}), micro-batch {args.micro_batch} x {cfg.seq_len}, '
    f'{cfg.num_params():,} params, {cfg.num_params(active=True):,} active, '
    f'{flops_per_token:.3e} FLOPs/token (active)'
  )
  print(
    f'{"what":<44} {"ms":>9} {"TFLOP/s":>9} {"rel err":>9} {"tokens/s":>10} {"MFU":>6} {"GiB":>6}'
  )
  for name, ms, tflops, err in gmm_rows:
    print(f'{name:<44} {ms:>9.3f} {tflops:>9.1f} {err:>9.1e} {"":>10} {"":>6} {"":>6}')
  for name, tps, step_mfu, mem in table:
    print(f'{name:<44} {"":>9} {"":>9} {"":>9} {tps:>10,.0f} {step_mfu:>6.3f} {mem:>6.1f}')
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
