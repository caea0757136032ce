"""LLaDA2.0-mini on one GPU: LoRA SFT (block diffusion) beside the family's own PyTorch code, and
block-cached decoding against its weight-read bound (docs/benchmarks.md, MoE; issue: LLaDA2.x).

    python -m benchmarks.llada2_lora --peer-code DIR  # GPU: dlmjax, then the peer
    python -m benchmarks.llada2_lora --peer-code DIR --only peer  # the peer alone (or dlmjax)
    python -m benchmarks.llada2_lora                  # GPU: dlmjax alone
    python -m benchmarks.llada2_lora --decode         # GPU: decode tok/s, grouped-matmul times
    python -m benchmarks.llada2_lora --tiny [--decode]  # CPU: a 2-layer LLaDA2, proves it runs

SFT: the llada2_mini preset (16.3B parameters, 1.43B active: 20 layers, the first dense, 256
experts top-8 in 8 groups, one shared expert), random bf16 weights, seq 2048 per stream, trained
as dFactory's tasks/train_llada2_bd.py trains it: one forward over [x_t || x_0] (4096 positions)
under the block-diffusion mask of 32-token blocks, cross-entropy on x_t's masked tokens. LoRA of
rank 128 (alpha 16) on what dlmjax's LoRA adapts in this model: the attention (q, k, v, o) and
the dense first layer's MLP; routed and shared experts stay frozen (docs/moe.md, Not yet). Both
sides recompute every layer in the backward pass (dlmjax remat=full; the peer's gradient
checkpointing) and take AdamW steps on one micro-batch each.

The peer is transformers + peft running dFactory's models/llada2_moe/ (modeling_llada2_moe.py,
configuration_llada2_moe.py), which this repository cannot hold: --peer-code names a folder
holding it (DIR/models/llada2_moe/ or that folder itself). Its model is built with random weights
from the config.json our exporter writes (checkpoint/families/llada2_moe.py), with model_type
llada2_moe: the Hub's per-expert modules and its Python loop over experts, because the fused
llada2_moe_veomni form calls VeOmni's fused MoE kernels and VeOmni is not installed. Imports that
VeOmni and older transformers provided are filled in before loading it: VeOmni's logger and
flags (liger off, no expert parallelism), transformers' `is_torch_fx_available` and the 'default'
RoPE initialiser (1 / theta^(2i / d) over the first partial_rotary_factor of each head). Its
attention is SDPA with dFactory's additive block-diffusion mask [B, 1, 2L, 2L]; its loss is
dFactory's: one mask ratio per row drawn in [0.3, 0.8], the masked tokens' mean CE (dlmjax's is
BD3LM's: a ratio per block, CE / ratio; the FLOPs are the same). peft adapts query_key_value
(one fused adapter where dlmjax has q, k and v's), dense and the dense layers' gate/up/down_proj.

Without --peer-code only dlmjax runs and the table says so (the CPU test runs that way). Each
side runs in its own process, one after the other. Peak memory: JAX's peak_bytes_in_use,
torch.cuda.max_memory_allocated. Correctness first: finite losses; the peer's base weight
unchanged and its adapters moved after a step.

--decode: mini-shape generation with the block cache (sampler.cache=block) and LLaDA2's
threshold 0.95, gen 256 after a 64-token prompt, blocks of 32, 32 steps a block, at batch 1 and 16
with token routing and at batch 1 with model.moe.block_experts=48 (the same weights): generated
tok/s, the forwards the threshold loop ran, and the step's time against its bound,
the active weights (num_params(active=True) less the embedding's gather, bf16) read once per
forward over memory bandwidth (4.8 TB/s H200, 3.35 TB/s H100). With random weights nothing
passes the threshold, so each forward commits one token: the bound is per forward. Beside it the
bound of reading every weight: a 32-token block routes to up to 256 of 256 experts. Then the
grouped matmuls of one MoE layer (gate, up, down of kernels/grouped_matmul.py, model.moe.backend)
at batch-1 decode (one block of 32 tokens, top-8), routed by the mini's router with token routing
and with model.moe.block_experts=48 (LLaDA2.2's C), in ms beside the experts each runs and those
given a non-zero weight (a token short of k pool experts has weight-0 choices; they run its
block's first pool expert, model/moe.py pool_first).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import types

RANK, ALPHA = 128, 16.0
TARGETS = 'q,k,v,o,gate,up,down'
NOISE_RANGE = (0.3, 0.8)  # dFactory's noise_range_low / noise_range_high (data_transform.py)
BLOCK_EXPERTS = 48  # LLaDA2.2's C of 256 (its report, section 2.2)
# Memory bandwidth by device kind (datasheets), as scripts/profile_decode.py reads it.
BANDWIDTHS = {'H100': 3.35e12, 'H200': 4.8e12}


def _shape(tiny: bool) -> dict:
  """model.* fields: llada2_mini at seq 2048, or a 2-layer LLaDA2 of the same kinds for CPU."""
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  if not tiny:
    return dict(presets.PRESETS['llada2_mini'], seq_len=2048)
  return dict(
    presets.PRESETS['llada2_mini'],
    num_layers=2,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    moe_ffn_dim=32,
    num_experts=8,
    experts_per_token=2,
    router_groups=4,
    router_group_topk=2,
    vocab_size=256,
    seq_len=32,
    block_size=8,
    mask_token_id=255,
    eos_token_id=254,
    pad_token_id=254,
  )


def _jax_config(args):
  """The SFT run config: block diffusion over the preset's blocks, LoRA on its targets."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  c = config_lib.defaults()
  c.stage = 'sft'
  c.init_from = 'random-weights'  # validation only: init_state draws the base
  config_lib.set_model_fields(c.model, _shape(args.tiny))
  c.diffusion.objective = 'block'
  c.model.dtype = 'bfloat16'
  c.model.remat = 'full'
  c.model.attention_backend = 'xla' if args.tiny else 'auto'
  c.model.loss_chunk_tokens = min(2048, args.micro_batch * c.model.seq_len)
  c.train.micro_batch_size = c.train.global_batch_size = args.micro_batch
  c.train.warmup_steps = c.train.wsd_decay_steps = 0
  c.train.schedule = 'constant'
  c.train.lr = 1e-4
  c.train.check_memory = False
  c.train.lora.rank, c.train.lora.alpha = (8 if args.tiny else RANK), ALPHA
  c.train.lora.targets = TARGETS
  c.train.lora.base_dtype = 'bfloat16'
  c.mesh.fsdp, c.mesh.data = 1, -1  # every device (one GPU; the CPU test's 8)
  config_lib.validate(c, 1)
  return c


def _jax_sft(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel

  result = bench.run(_jax_config(args), args.steps, args.warmup, matmul=False)
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


def _peer_folder(path: str) -> str:
  for folder in (os.path.join(path, 'models', 'llada2_moe'), path):
    if os.path.isfile(os.path.join(folder, 'modeling_llada2_moe.py')):
      return folder
  raise SystemExit(
    f'--peer-code {path}: no modeling_llada2_moe.py in it or in its models/llada2_moe/; '
    'give the folder of a clone of inclusionAI/dFactory.'
  )


def _fill_missing_imports() -> None:
  """What dFactory's modeling file imports from VeOmni and from older transformers (module
  docstring): VeOmni's logger and flags, is_torch_fx_available, the 'default' RoPE init."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import modeling_rope_utils  # pylint: disable=import-outside-toplevel
  from transformers.utils import import_utils  # pylint: disable=import-outside-toplevel
  from transformers.utils import logging  # pylint: disable=import-outside-toplevel

  def refuse(*args, **kwargs):
    raise SystemExit('peer: VeOmni kernels are not installed; the peer runs model_type llada2_moe')

  modules = {
    'veomni': {},
    'veomni.ops': dict(causallm_loss_function=refuse, fused_moe_forward=refuse),
    'veomni.distributed': {},
    'veomni.distributed.parallel_state': dict(
      get_parallel_state=lambda: types.SimpleNamespace(ep_enabled=False)
    ),
    'veomni.utils': dict(logging=logging),
    'veomni.utils.import_utils': dict(is_liger_kernel_available=lambda: False),
  }
  for name, attrs in modules.items():
    if name not in sys.modules:
      module = types.ModuleType(name)
      module.__dict__.update(attrs)
      sys.modules[name] = module
  if not hasattr(import_utils, 'is_torch_fx_available'):
    import_utils.is_torch_fx_available = lambda: False
  if 'default' not in modeling_rope_utils.ROPE_INIT_FUNCTIONS:

    def default_rope(config, device=None, seq_len=None):
      head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
      dim = int(head_dim * getattr(config, 'partial_rotary_factor', 1.0))
      exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
      return 1.0 / (config.rope_theta**exponent), 1.0

    modeling_rope_utils.ROPE_INIT_FUNCTIONS['default'] = default_rope


def _peer_module(path: str):
  """dFactory's llada2_moe package, imported from its folder under a private name."""
  folder = _peer_folder(path)
  _fill_missing_imports()
  name = 'llada2_moe_peer'
  spec = importlib.util.spec_from_file_location(
    name, os.path.join(folder, '__init__.py'), submodule_search_locations=[folder]
  )
  package = importlib.util.module_from_spec(spec)
  sys.modules[name] = package
  spec.loader.exec_module(package)
  return importlib.import_module(f'{name}.modeling_llada2_moe')


def block_diffusion_mask(length: int, block: int):
  """bool [2L, 2L]: dFactory's block_diffusion_mask over [x_t || x_0] (the reference notes, 1.7):
  x_t sees its own block of x_t and the earlier blocks of x_0; x_0 sees x_0 block-causally."""
  import torch  # pylint: disable=import-outside-toplevel

  index = torch.arange(2 * length)
  clean = index >= length
  blocks = torch.where(clean, index - length, index) // block
  q_clean, k_clean = clean[:, None], clean[None, :]
  q_block, k_block = blocks[:, None], blocks[None, :]
  diagonal = (q_block == k_block) & (q_clean == k_clean)
  offset_causal = (q_block > k_block) & k_clean & ~q_clean
  causal = (q_block >= k_block) & k_clean & q_clean
  return diagonal | offset_causal | causal


def _peer_targets(hf) -> list:
  """peft targets (module-name suffixes) for what dlmjax's LoRA adapts (module docstring)."""
  projections = ('gate_proj', 'up_proj', 'down_proj')
  dense = [f'layers.{i}.mlp.{p}' for i in range(hf.first_k_dense_replace) for p in projections]
  return ['query_key_value', 'dense', *dense]


def _torch_sft(args) -> dict:
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  from dlmjax.checkpoint.families import llada2_moe  # pylint: disable=import-outside-toplevel

  modeling = _peer_module(args.peer_code)
  c = _jax_config(args)
  m = c.model
  fields = llada2_moe.write(c, vocab_rows=m.vocab_size, dtype='bf16')
  fields.update(model_type='llada2_moe', use_cache=False)
  hf = modeling.LLaDA2MoeConfig(**fields)
  hf.model_type = 'llada2_moe'  # the per-expert modules (module docstring)
  hf._attn_implementation = 'sdpa'
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  torch.manual_seed(0)
  default_dtype = torch.get_default_dtype()
  torch.set_default_dtype(torch.bfloat16)  # build in bf16: no float32 copy of 16B parameters
  try:
    with torch.device(device):
      model = modeling.LLaDA2MoeModelLM(hf)
  finally:
    torch.set_default_dtype(default_dtype)
  model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
  model.enable_input_require_grads()
  lora = peft.LoraConfig(r=c.train.lora.rank, lora_alpha=ALPHA, target_modules=_peer_targets(hf))
  model = peft.get_peft_model(model, lora)
  model.train()
  trainable = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
  qkv = model.base_model.model.model.layers[0].attention.query_key_value
  base_before = qkv.base_layer.weight.detach().clone()
  rows, length = args.micro_batch, m.seq_len
  visible = block_diffusion_mask(length, m.block_size).to(device)
  additive = torch.zeros(visible.shape, dtype=torch.bfloat16, device=device)
  additive = additive.masked_fill(~visible, float('-inf'))[None, None].expand(rows, -1, -1, -1)
  positions = torch.arange(length, device=device).repeat(2)[None].expand(rows, -1)
  generator = torch.Generator(device=device).manual_seed(0)
  low, high = NOISE_RANGE

  def step():
    clean = torch.randint(0, m.mask_token_id, (rows, length), device=device, generator=generator)
    ratio = low + (high - low) * torch.rand(rows, 1, device=device, generator=generator)
    masked = torch.rand(rows, length, device=device, generator=generator) < ratio
    noisy = torch.where(masked, torch.full_like(clean, m.mask_token_id), clean)
    logits = model(
      input_ids=torch.cat([noisy, clean], 1),
      attention_mask=additive,
      position_ids=positions,
      use_cache=False,
    ).logits[:, :length]
    labels = torch.where(masked, clean, torch.full_like(clean, -100))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction='sum')
    loss = ce / masked.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  loss = step()
  if not torch.equal(qkv.base_layer.weight, base_before):
    raise SystemExit('peer: the base weight moved')
  if not qkv.lora_B['default'].weight.abs().max() > 0:
    raise SystemExit('peer: the adapters did not move')
  for _ in range(args.warmup):
    step()
  _sync(device)
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step()
  _sync(device)
  step_s = (time.perf_counter() - start) / args.steps
  if not math.isfinite(float(loss)):
    raise SystemExit(f'peer: non-finite loss {float(loss)}')
  return dict(
    side='dFactory llada2_moe + peft (PyTorch)',
    tokens_per_s=round(rows * length / step_s),
    step_s=round(step_s, 4),
    peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == 'cuda' else None,
    loss=float(loss),
    device=torch.cuda.get_device_name() if device == 'cuda' else 'cpu',
  )


def _sync(device: str) -> None:
  import torch  # pylint: disable=import-outside-toplevel

  if device == 'cuda':
    torch.cuda.synchronize()


PARTS = dict(jax_sft=_jax_sft, torch_sft=_torch_sft)


def _run_part(part: str, args) -> dict:
  """One side in its own process; its last stdout line is its JSON result."""
  argv = [sys.executable, '-m', 'benchmarks.llada2_lora', '--part', part]
  argv += ['--micro-batch', str(args.micro_batch), '--steps', str(args.steps)]
  argv += ['--warmup', str(args.warmup)]
  argv += ['--peer-code', args.peer_code] if args.peer_code else []
  argv += ['--tiny'] if args.tiny else []
  out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ), check=False)
  lines = [line for line in out.stdout.splitlines() if line.startswith('{')]
  if out.returncode or not lines:
    side = 'dlmjax (JAX)' if part.startswith('jax') else 'dFactory llada2_moe + peft (PyTorch)'
    return dict(side=side, error=f'exit {out.returncode}: {out.stdout.strip()[-300:]}')
  return json.loads(lines[-1])


def sft_table(rows, args) -> str:
  shape = _shape(args.tiny)
  lines = [
    f'LoRA SFT, block diffusion: {shape["num_layers"]} layers x d_model {shape["d_model"]}, '
    f'{shape["num_experts"]} experts top-{shape["experts_per_token"]}, seq {shape["seq_len"]} x 2 '
    f'streams, block {shape["block_size"]}, micro-batch {args.micro_batch}, rank '
    f'{8 if args.tiny else RANK}, bf16 base, remat full',
    f'{"side":<38} {"tokens/s":>9} {"step s":>8} {"peak GiB":>8} {"loss":>8}',
  ]
  for r in rows:
    if 'error' in r:
      lines.append(f'{r["side"]:<38} failed: {r["error"]}')
      continue
    peak = '-' if r['peak_gib'] is None else f'{r["peak_gib"]:.1f}'
    lines.append(
      f'{r["side"]:<38} {r["tokens_per_s"]:>9,} {r["step_s"]:>8.3f} {peak:>8} {r["loss"]:>8.3f}'
    )
  ok = [r for r in rows if 'error' not in r]
  if len(ok) == 2:
    lines.append(f'dlmjax / peer speed {ok[0]["tokens_per_s"] / ok[1]["tokens_per_s"]:.2f}x')
  if not args.peer_code:
    lines.append('peer not run: give --peer-code DIR (a clone of inclusionAI/dFactory)')
  elif args.only != 'both':
    lines.append(f'--only {args.only}: one side ran')
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# --decode


def _bandwidth() -> float:
  import jax  # pylint: disable=import-outside-toplevel

  kind = jax.devices()[0].device_kind
  return next((bw for name, bw in BANDWIDTHS.items() if name in kind), BANDWIDTHS['H200'])


def _decode_setup(tiny: bool):
  """(ModelConfig, bf16 params, model fields) of the mini (or tiny) shape, random weights."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel

  c = config_lib.defaults()
  config_lib.set_model_fields(c.model, _shape(tiny))
  c.model.dtype = 'bfloat16'
  c.model.remat = 'none'
  if jax.default_backend() != 'gpu':
    c.model.attention_backend = c.model.norm_backend = 'xla'
  model_config = model_lib.ModelConfig.from_config(c)

  def init(key):  # one program: the float32 draw never lives beside its bf16 copy
    params = model_lib.init_params(model_config, key)
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)

  return model_config, jax.jit(init)(jax.random.key(0)), c.model


def forwards_run(steps_BG, steps_per_block: int) -> int:
  """Forwards a batched block decode ran: per block, the most steps any row took (its last
  commit step + 1), from the sampler's per-token commit steps (-1: none)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  steps = np.asarray(steps_BG)
  steps = steps[steps >= 0]
  if not steps.size:
    return 0
  blocks, within = steps // steps_per_block, steps % steps_per_block
  return int(sum(within[blocks == b].max() + 1 for b in np.unique(blocks)))


def decode_rows(args) -> list:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax.diffusion import sampler_programs, sampling_config  # pylint: disable=import-outside-toplevel

  model_config, params, m = _decode_setup(args.tiny)
  prompt, gen, block = (8, 16, 8) if args.tiny else (64, 256, 32)
  sampling = sampling_config.SamplingConfig(
    gen_length=gen, steps=gen, block_length=block, threshold=0.95, cache='block'
  ).validate()
  active = model_config.num_params(active=True) - model_config.vocab_size * model_config.d_model
  every = model_config.num_params() - model_config.vocab_size * model_config.d_model
  bound_ms = 2 * active / _bandwidth() * 1e3
  every_ms = 2 * every / _bandwidth() * 1e3

  def decode_fn(pool):
    """The program generate runs (sampler_programs.make_generate_fn: weights cast and fused
    once, the decode compiler options of model/programs.py), block routing with `pool` experts."""
    return sampler_programs.make_generate_fn(
      dataclasses.replace(model_config, block_experts=pool),
      sampling,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      vocab_size=m.vocab_size,
      with_steps=True,
    )

  rows = []
  rng = np.random.default_rng(0)
  pool = 4 if args.tiny else BLOCK_EXPERTS
  # (batch, block_experts): batch 1 and 16 routed per token, and batch 1 with block routing.
  for batch, pool in ((1, 0), (2, 0), (1, pool)) if args.tiny else ((1, 0), (16, 0), (1, pool)):
    prompt_BP = rng.integers(0, m.mask_token_id, (batch, prompt)).astype(np.int32)
    lengths_B = np.full(batch, prompt, np.int32)
    call = (params, prompt_BP, lengths_B, jax.random.key(0))
    compiled = decode_fn(pool).lower(*call).compile()
    jax.block_until_ready(compiled(*call))
    start = time.perf_counter()
    tokens, steps = jax.block_until_ready(compiled(*call))
    seconds = time.perf_counter() - start
    if (np.asarray(tokens)[:, prompt:] == m.mask_token_id).any():
      raise SystemExit('decode: a generated token is still MASK')
    forwards = forwards_run(steps, sampling.steps_per_block)
    step_ms = seconds / max(forwards, 1) * 1e3
    rows.append(
      dict(
        batch=batch,
        block_experts=pool,
        tokens_per_s=round(batch * gen / seconds, 1),
        forwards=forwards,
        step_ms=round(step_ms, 3),
        bound_ms=round(bound_ms, 3),
        pct_bound=round(100 * bound_ms / step_ms, 1),
        every_weight_ms=round(every_ms, 3),
      )
    )
  return rows


def grouped_matmul_rows(args) -> list:
  """One MoE layer's grouped matmuls at batch-1 decode (one block), token vs block routing."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from benchmarks import timing  # pylint: disable=import-outside-toplevel
  from dlmjax.model import moe  # pylint: disable=import-outside-toplevel

  s = _shape(args.tiny)
  pools = (0, 4) if args.tiny else (0, BLOCK_EXPERTS)
  x_BLD = jax.random.normal(jax.random.key(1), (1, s['block_size'], s['d_model']), jnp.bfloat16)
  rows = []
  for pool in pools:
    layer = moe.MoE(
      s['d_model'],
      s['num_experts'],
      s['experts_per_token'],
      s['moe_ffn_dim'],
      router=s['router'],
      shared_ffn_dim=0,
      router_groups=s['router_groups'],
      router_group_topk=s['router_group_topk'],
      routed_scale=s['routed_scale'],
      std=0.02,
      out_std=0.02,
      rngs=nnx.Rngs(0),  # the same router and experts for both
      block_experts=pool,
      block_size=s['block_size'],
    )
    experts_BLK, weights_BLK, _ = layer.route(x_BLD)
    w = [p.value.astype(jnp.bfloat16) for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]
    x_TD, experts_A = x_BLD[0], experts_BLK.reshape(-1)

    def run(x_TD, experts_A, gate, up, down):
      return moe.run_experts(
        x_TD, experts_A, gate, up, down, rows_per_token=s['experts_per_token'], backend='auto'
      )

    ms = timing.median_ms(run, (x_TD, experts_A, *w), iters=3 if args.tiny else 50)
    rows.append(
      dict(
        block_experts=pool,
        experts_touched=int(np.unique(np.asarray(experts_A)).size),
        # A token short of k pool experts has weight-0 choices (docs/moe.md): run, not weighted.
        experts_weighted=int(np.unique(np.asarray(experts_BLK)[np.asarray(weights_BLK) > 0]).size),
        grouped_matmul_ms=round(ms, 4),
      )
    )
  return rows


def decode_table(decodes, matmuls) -> str:
  lines = [
    'decode, block cache, threshold 0.95 (random weights: one token a forward):',
    f'{"batch":>5} {"block_experts":>13} {"tok/s":>9} {"forwards":>8} {"step ms":>8} '
    f'{"bound ms":>8} {"% bound":>7} {"all-weights ms":>14}',
  ]
  for r in decodes:
    lines.append(
      f'{r["batch"]:>5} {r["block_experts"]:>13} {r["tokens_per_s"]:>9} {r["forwards"]:>8} '
      f'{r["step_ms"]:>8} '
      f'{r["bound_ms"]:>8} {r["pct_bound"]:>7} {r["every_weight_ms"]:>14}'
    )
  lines.append('grouped matmuls of one MoE layer at batch-1 decode (one block):')
  lines.append(f'{"block_experts":>13} {"experts run":>11} {"weighted":>8} {"ms":>8}')
  for r in matmuls:
    lines.append(
      f'{r["block_experts"]:>13} {r["experts_touched"]:>11} {r["experts_weighted"]:>8} '
      f'{r["grouped_matmul_ms"]:>8}'
    )
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.llada2_lora', description=__doc__)
  parser.add_argument('--tiny', action='store_true', help='a 2-layer LLaDA2 on CPU')
  parser.add_argument('--decode', action='store_true', help='decode and grouped-matmul timings')
  parser.add_argument('--peer-code', default='', help='a clone of dFactory (models/llada2_moe/)')
  parser.add_argument(
    '--only', choices=('both', 'dlmjax', 'peer'), default='both', help='the SFT side(s) to run'
  )
  parser.add_argument('--micro-batch', type=int, default=4, help='SFT rows per step')
  parser.add_argument('--steps', type=int, default=3, help='timed SFT steps')
  parser.add_argument('--warmup', type=int, default=1, help='untimed SFT steps')
  parser.add_argument('--part', choices=tuple(PARTS), default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.part:
    print(json.dumps(PARTS[args.part](args)), flush=True)
    return 0
  if args.decode:
    decodes, matmuls = decode_rows(args), grouped_matmul_rows(args)
    for r in decodes + matmuls:
      print(json.dumps(r), flush=True)
    print(decode_table(decodes, matmuls), flush=True)
    return 0
  if args.peer_code:
    _peer_folder(args.peer_code)  # a wrong folder fails here, in one line, before any run
  if args.only == 'peer' and not args.peer_code:
    raise SystemExit('--only peer needs --peer-code DIR (a clone of inclusionAI/dFactory)')
  parts = [] if args.only == 'peer' else ['jax_sft']
  parts += ['torch_sft'] if args.peer_code and args.only != 'dlmjax' else []
  rows = [_run_part(part, args) for part in parts]
  for r in rows:
    print(json.dumps(r), flush=True)
  print(sft_table(rows, args), flush=True)
  return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
