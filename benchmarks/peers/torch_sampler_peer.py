"""Peer for sampler speed: LLaDA's generate loop (low-confidence remasking, temperature 0,
semi-autoregressive blocks) over a transformers Qwen3 1.7B with bidirectional SDPA, bf16.
Prints generated tokens/s (docs/benchmarks.md, Sampler):
    python benchmarks/peers/torch_sampler_peer.py --batch 64 --prompt 64 --gen 256 --steps 256 \
        --block 32 [--compile]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM


def bidirectional_sdpa(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):
  gqa = q.shape[1] != k.shape[1]  # grouped-query attention: SDPA shares each K/V head itself
  out = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=scaling, enable_gqa=gqa)
  return out.transpose(1, 2).contiguous(), None


def transfer_counts(mask_count, steps):
  base = mask_count // steps
  rem = mask_count % steps
  counts = base[:, None] + torch.zeros(
    mask_count.size(0), steps, device=mask_count.device, dtype=torch.int64
  )
  for i in range(mask_count.size(0)):
    counts[i, : rem[i]] += 1
  return counts


@torch.no_grad()
def generate(model, prompt, gen, steps, block, mask_id, max_blocks=None):
  b, p = prompt.shape
  x = torch.full((b, p + gen), mask_id, dtype=torch.long, device=prompt.device)
  x[:, :p] = prompt
  blocks = gen // block
  steps_per_block = steps // blocks
  for nb in range(blocks if max_blocks is None else max_blocks):
    lo, hi = p + nb * block, p + (nb + 1) * block
    counts = transfer_counts((x[:, lo:hi] == mask_id).sum(1), steps_per_block)
    for i in range(steps_per_block):
      masked = x == mask_id
      logits = model(x).logits
      x0 = logits.argmax(-1)
      conf = torch.gather(F.softmax(logits.float(), -1), -1, x0[..., None]).squeeze(-1)
      conf[:, hi:] = -float('inf')
      x0 = torch.where(masked, x0, x)
      conf = torch.where(masked, conf, torch.tensor(-float('inf'), device=x.device))
      sel = torch.zeros_like(x0, dtype=torch.bool)
      for j in range(b):
        _, idx = torch.topk(conf[j], k=int(counts[j, i]))
        sel[j, idx] = True
      x[sel] = x0[sel]
  return x


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--batch', type=int, default=64)
  ap.add_argument('--prompt', type=int, default=64)
  ap.add_argument('--gen', type=int, default=256)
  ap.add_argument('--steps', type=int, default=256)
  ap.add_argument('--block', type=int, default=32)
  ap.add_argument('--compile', action='store_true')
  ap.add_argument('--repeats', type=int, default=2)
  a = ap.parse_args()
  AttentionInterface.register('bidir_sdpa', bidirectional_sdpa)
  cfg = Qwen3Config(
    vocab_size=50289,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_bias=False,
  )
  cfg._attn_implementation = 'bidir_sdpa'
  torch.manual_seed(0)
  model = Qwen3ForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
  if a.compile:
    model.forward = torch.compile(model.forward)
  mask_id = 50277
  prompt = torch.randint(4, 1000, (a.batch, a.prompt), device='cuda')
  generate(model, prompt, a.gen, a.steps, a.block, mask_id, max_blocks=1)  # warm up, same shapes
  torch.cuda.synchronize()
  best = float('inf')
  for _ in range(a.repeats):
    t0 = time.perf_counter()
    generate(model, prompt, a.gen, a.steps, a.block, mask_id)
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t0)
  print(
    json.dumps(
      {
        'peer': 'torch-llada-loop' + ('-compile' if a.compile else '-eager'),
        'batch': a.batch,
        'prompt': a.prompt,
        'gen': a.gen,
        'steps': a.steps,
        'block': a.block,
        'seconds': round(best, 3),
        'tokens_per_s': round(a.batch * a.gen / best, 1),
        'peak_mem_gib': round(torch.cuda.max_memory_allocated() / 2**30, 1),
      }
    ),
    flush=True,
  )


if __name__ == '__main__':
  main()
