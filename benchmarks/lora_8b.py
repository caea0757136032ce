"""LoRA SFT of the LLaDA-8B shape on one GPU: dlmjax beside transformers + peft (docs/lora.md).

    python -m benchmarks.lora_8b                      # GPU: llada_8b, bf16 base, rank 128
    python -m benchmarks.lora_8b --tiny               # CPU: a 2-layer model, proves it runs

Both sides train rank-128 adapters on all seven projections (q, k, v, o, gate, up, down) of a
random-weight bf16 base with AdamW, bidirectional attention, seq 2048, and recompute every layer
in the backward pass (dlmjax remat=full; transformers' gradient checkpointing), on one
micro-batch per step. The masked-diffusion loss is LLaDA's on both (a random mask ratio per row,
cross-entropy on the masked tokens / ratio). Each side runs in its own process, one after the
other, so two 8B models never share the GPU and JAX's preallocation does not starve PyTorch.
Reported: tokens/s over the timed steps and the peak device memory (JAX's peak_bytes_in_use,
torch.cuda.max_memory_allocated). Correctness: the losses are finite; the peer's first step leaves
its base weight unchanged and moves its adapters (dlmjax's base is outside its train state; its
tests are tests/train/lora_test.py). The last lines are one table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

RANK, ALPHA = 128, 16.0
TARGETS = 'q,k,v,o,gate,up,down'
HF_TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']


def _shape(tiny: bool) -> dict:
  if tiny:
    return dict(
      num_layers=2,
      d_model=64,
      num_heads=4,
      num_kv_heads=4,
      head_dim=16,
      ffn_dim=128,
      vocab_size=256,
      seq_len=64,
      rope_theta=5e5,
      norm_eps=1e-5,
    )
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  shape = {k: v for k, v in presets.PRESETS['llada_8b'].items() if not k.endswith('token_id')}
  return dict(shape, seq_len=2048)


def _jax_part(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  shape = _shape(args.tiny)
  c = config_lib.defaults()
  c.stage = 'sft'
  c.init_from = 'random-weights'  # validation only: init_state draws the base
  for key, value in shape.items():
    c.model[key] = value
  c.model.dtype = 'bfloat16'
  c.model.remat = args.remat
  c.model.attention_backend = 'xla' if args.tiny else 'auto'
  c.model.loss_chunk_tokens = min(2048, args.micro_batch * shape['seq_len'])
  c.train.micro_batch_size = c.train.global_batch_size = args.micro_batch
  c.train.warmup_steps = c.train.wsd_decay_steps = 0
  c.train.schedule = 'constant'
  c.train.lr = 1e-4
  c.train.check_memory = False
  c.train.lora.rank, c.train.lora.alpha = RANK if not args.tiny else 8, ALPHA
  c.train.lora.targets = TARGETS
  c.train.lora.base_dtype = 'bfloat16'
  c.mesh.fsdp = 1
  config_lib.validate(c, 1)
  result = bench.run(c, args.steps, args.warmup, matmul=False)
  if not np.isfinite(result['loss']):
    raise SystemExit(f'dlmjax: non-finite loss {result["loss"]}')
  return dict(
    side='dlmjax (JAX)',
    tokens_per_s=result['tokens_per_s'],
    step_s=result['step_time_s'],
    peak_gib=result.get('peak_mem_gib'),
    loss=result['loss'],
    device=jax.devices()[0].device_kind,
  )


def _llada_loss(model, tokens, mask_id, generator):
  """LLaDA's masked-diffusion loss: ratio t ~ U(eps, 1) per row, CE on masked tokens / t."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  rows, length = tokens.shape
  eps = 1e-3
  t = (1 - eps) * torch.rand(rows, 1, device=tokens.device, generator=generator) + eps
  masked = torch.rand(rows, length, device=tokens.device, generator=generator) < t
  noised = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
  logits = model(input_ids=noised, use_cache=False).logits
  ce = F.cross_entropy(logits.float().transpose(1, 2), tokens, reduction='none')
  return ((ce * masked) / t).sum() / (rows * length)


def _torch_part(args) -> dict:
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from benchmarks.peers import torch_sampler_peer  # pylint: disable=import-outside-toplevel

  shape = _shape(args.tiny)
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  transformers.AttentionInterface.register('bidir_sdpa', torch_sampler_peer.bidirectional_sdpa)
  hf = transformers.LlamaConfig(
    vocab_size=shape['vocab_size'],
    hidden_size=shape['d_model'],
    intermediate_size=shape['ffn_dim'],
    num_hidden_layers=shape['num_layers'],
    num_attention_heads=shape['num_heads'],
    num_key_value_heads=shape['num_kv_heads'],
    head_dim=shape['head_dim'],
    rope_theta=shape['rope_theta'],
    rms_norm_eps=shape['norm_eps'],
    max_position_embeddings=shape['seq_len'],
    tie_word_embeddings=False,
  )
  hf._attn_implementation = 'bidir_sdpa'  # bidirectional SDPA, no mask
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
  model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
  model.enable_input_require_grads()
  lora_config = peft.LoraConfig(
    r=RANK if not args.tiny else 8, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS
  )
  model = peft.get_peft_model(model, lora_config)  # adapters in float32 (autocast_adapter_dtype)
  model.train()
  trainable = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
  base_before = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
  generator = torch.Generator(device=device).manual_seed(0)
  rows, length = args.micro_batch, shape['seq_len']

  def step():
    tokens = torch.randint(0, shape['vocab_size'] - 1, (rows, length), device=device)
    loss = _llada_loss(model, tokens, shape['vocab_size'] - 1, generator)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss

  def sync():
    if device == 'cuda':
      torch.cuda.synchronize()

  loss = step()
  layer = model.base_model.model.model.layers[0].self_attn.q_proj
  if not torch.equal(layer.base_layer.weight, base_before):
    raise SystemExit('peer: the base weight moved')
  if not layer.lora_B['default'].weight.abs().max() > 0:
    raise SystemExit('peer: the adapters did not move')
  for _ in range(args.warmup):
    step()
  sync()
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step()
  sync()
  step_s = (time.perf_counter() - start) / args.steps
  loss = loss.detach()
  if not math.isfinite(float(loss)):
    raise SystemExit(f'peer: non-finite loss {float(loss)}')
  peak = torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else None
  return dict(
    side='transformers + peft (PyTorch)',
    tokens_per_s=round(rows * length / step_s),
    step_s=round(step_s, 4),
    peak_gib=None if peak is None else round(peak, 1),
    loss=float(loss),
    device=torch.cuda.get_device_name() if device == 'cuda' else 'cpu',
  )


def _run_part(part: str, args) -> dict:
  """One side in its own process; its last stdout line is its JSON result."""
  argv = [sys.executable, '-m', 'benchmarks.lora_8b', '--part', part]
  argv += ['--micro-batch', str(args.micro_batch), '--steps', str(args.steps)]
  argv += ['--warmup', str(args.warmup), '--remat', args.remat] + (['--tiny'] if args.tiny else [])
  out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ), check=False)
  lines = [line for line in out.stdout.splitlines() if line.startswith('{')]
  if out.returncode or not lines:
    return dict(side=part, error=f'exit {out.returncode}: {out.stdout.strip()[-300:]}')
  return json.loads(lines[-1])


def _table(rows, args) -> str:
  shape = _shape(args.tiny)
  head = (
    f'LoRA SFT, {shape["num_layers"]} layers x d_model {shape["d_model"]}, seq '
    f'{shape["seq_len"]}, micro-batch {args.micro_batch}, rank {RANK if not args.tiny else 8}, '
    f'targets {TARGETS}, bf16 base, remat {args.remat}'
  )
  lines = [head, f'{"side":<32} {"tokens/s":>10} {"step s":>8} {"peak GiB":>9} {"loss":>8}']
  for r in rows:
    if 'error' in r:
      lines.append(f'{r["side"]:<32} failed: {r["error"]}')
      continue
    peak = '-' if r['peak_gib'] is None else f'{r["peak_gib"]:.1f}'
    lines.append(
      f'{r["side"]:<32} {r["tokens_per_s"]:>10,} {r["step_s"]:>8.3f} {peak:>9} {r["loss"]:>8.3f}'
    )
  ok = [r for r in rows if 'error' not in r]
  if len(ok) == 2:
    lines.append(f'dlmjax / peer tokens/s: {ok[0]["tokens_per_s"] / ok[1]["tokens_per_s"]:.2f}x')
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.lora_8b', description=__doc__)
  parser.add_argument('--tiny', action='store_true', help='a 2-layer model on CPU')
  # 80 GiB: micro-batch 4 with remat full is ~31 GiB by dlmjax.summary's estimate (8: ~39).
  parser.add_argument('--micro-batch', type=int, default=4)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--warmup', type=int, default=1)
  parser.add_argument('--remat', default='full', help='dlmjax model.remat (peer: checkpointing)')
  parser.add_argument('--part', choices=('jax', 'torch'), default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.part == 'jax':
    print(json.dumps(_jax_part(args)), flush=True)
    return 0
  if args.part == 'torch':
    print(json.dumps(_torch_part(args)), flush=True)
    return 0
  rows = [_run_part('jax', args), _run_part('torch', args)]
  for r in rows:
    print(json.dumps(r), flush=True)
  print(_table(rows, args), flush=True)
  return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
