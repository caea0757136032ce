"""LoRA SFT and one d1 RL iteration of the LLaDA-8B shape on one GPU: dlmjax beside
transformers + peft (docs/lora.md, Benchmark).

    python -m benchmarks.lora_8b                      # GPU: llada_8b, bf16 base, rank 128
    python -m benchmarks.lora_8b --tiny               # CPU: a 2-layer model, proves it runs
    python -m benchmarks.lora_8b --only rl            # the RL iteration alone (or --only sft)
    python -m benchmarks.lora_8b --only rl --cache dual  # dlmjax's rollouts with the dual cache
    python -m benchmarks.lora_8b --base-dtype nf4     # dlmjax's base in NF4 (QLoRA, as d1)

SFT: both sides train rank-128 adapters on all seven projections (q, k, v, o, gate, up, down) of a
random-weight bf16 base with AdamW, bidirectional attention, seq 2048, and recompute every layer
in the backward pass (dlmjax remat=full; transformers' gradient checkpointing), on one
micro-batch per step. The masked-diffusion loss is LLaDA's on both (a random mask ratio per row,
cross-entropy on the masked tokens / ratio).

RL: one diffu-GRPO iteration at d1's setting (dllm-reasoning/d1, diffu-grpo/slurm_scripts and
train.yaml): LoRA rank 128, alpha 64, dropout 0.05, all seven projections; G = 6 completions per
prompt and 12 rows per GPU (per-device batch 6 x gradient accumulation 2); 200-token prompts,
256-token completions in blocks of 32 with 128 diffusion steps (low-confidence remasking;
temperature 0 on both sides, where d1 samples at 0.9 with Gumbel noise); mu = 12 updates per
rollout (GSM8K / MATH); one-step token log-probs with prompt tokens masked w.p. 0.15; KL beta
0.04, clip 0.5; AdamW (0.9, 0.99), weight decay 0.1, clip 0.2. The phases: generate (the
rollout), score (the old policy's and the reference's log-probs for each of the mu mask seeds;
the reference is the base with the adapters off, dlmjax's frozen tree and peft's
disable_adapter, no second copy), update (one optimizer step over the 12 rows). iteration s =
generate + score + mu x update.

d1 trains on a 4-bit NF4 base (bitsandbytes); --base-dtype nf4 gives dlmjax that base, while the
peer stays bf16: the GPU image has no bitsandbytes.

Each side runs in its own process, one after the other, so two 8B models never share the GPU and
JAX's preallocation does not starve PyTorch. Peak memory: JAX's peak_bytes_in_use,
torch.cuda.max_memory_allocated. Correctness first: finite losses; the peer's base weight
unchanged and its adapters moved after an update; in RL on both sides the reference's log-probs
equal the policy's at step 0 (B = 0) and differ after the updates, and no completion keeps a mask
token. The last lines are one table.
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


def _d1(tiny: bool) -> dict:
  """d1's RL setting per GPU (module docstring); tiny: the same structure, CPU-sized."""
  if tiny:
    return dict(
      rank=8, alpha=32.0, group=2, rows=4, micro=2, prompt=16, gen=32, block=8, steps=8, mu=2
    )
  return dict(
    rank=128, alpha=64.0, group=6, rows=12, micro=6, prompt=200, gen=256, block=32, steps=128, mu=12
  )


D1_OPT = dict(
  lr=3e-6, b2=0.99, weight_decay=0.1, clip=0.2, beta=0.04, eps=0.5, p_mask_prompt=0.15, dropout=0.05
)


def _shape(tiny: bool) -> dict:
  """The model's fields: llada_8b (its token ids too) or a 2-layer CPU model."""
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
      mask_token_id=255,
      eos_token_id=254,
      pad_token_id=254,
    )
  from dlmjax.model import presets  # pylint: disable=import-outside-toplevel

  return dict(presets.PRESETS['llada_8b'], seq_len=2048)


def _jax_config(args, stage: str):
  """The run config of one side's stage: SFT at seq 2048, or RL at d1's setting."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  shape = _shape(args.tiny)
  c = config_lib.defaults()
  c.stage = stage
  c.init_from = 'random-weights'  # validation only: init_state draws the base
  for key, value in shape.items():
    c.model[key] = value
  c.model.dtype = 'bfloat16'
  c.model.remat = args.remat
  c.model.attention_backend = 'xla' if args.tiny else 'auto'
  c.train.warmup_steps = c.train.wsd_decay_steps = 0
  c.train.schedule = 'constant'
  c.train.check_memory = False
  c.train.lora.targets = TARGETS
  c.train.lora.base_dtype = args.base_dtype
  c.mesh.fsdp = 1
  if stage == 'sft':
    c.model.loss_chunk_tokens = min(2048, args.micro_batch * shape['seq_len'])
    c.train.micro_batch_size = c.train.global_batch_size = args.micro_batch
    c.train.lr = 1e-4
    c.train.lora.rank, c.train.lora.alpha = RANK if not args.tiny else 8, ALPHA
  else:
    d1 = _d1(args.tiny)
    c.model.seq_len = d1['prompt'] + d1['gen']
    c.model.loss_chunk_tokens = min(2048, d1['micro'] * c.model.seq_len)
    c.train.micro_batch_size, c.train.global_batch_size = d1['micro'], d1['rows']
    c.train.lr, c.train.b2 = D1_OPT['lr'], D1_OPT['b2']
    c.train.weight_decay, c.train.clip_grad_norm = D1_OPT['weight_decay'], D1_OPT['clip']
    c.train.lora.rank, c.train.lora.alpha = d1['rank'], d1['alpha']
    c.train.lora.dropout = D1_OPT['dropout']
    c.rl.objective = 'd1'
    c.rl.group_size, c.rl.inner_updates = d1['group'], d1['mu']
    c.rl.max_prompt_tokens = d1['prompt']
    c.rl.kl_beta, c.rl.clip_eps = D1_OPT['beta'], D1_OPT['eps']
    c.rl.p_mask_prompt = D1_OPT['p_mask_prompt']
    c.sampler.gen_length, c.sampler.steps = d1['gen'], d1['steps']
    c.sampler.block_length, c.sampler.temperature = d1['block'], 0.0
    c.sampler.cache = args.cache  # dlmjax's rollouts; the peer's loop has no cache
  config_lib.validate(c, 1)
  return c


def _jax_sft(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel

  c = _jax_config(args, 'sft')
  result = bench.run(c, args.steps, args.warmup, matmul=False)
  if not np.isfinite(result['loss']):
    raise SystemExit(f'dlmjax: non-finite loss {result["loss"]}')
  return dict(
    task='sft',
    side='dlmjax (JAX)',
    tokens_per_s=result['tokens_per_s'],
    step_s=result['step_time_s'],
    peak_gib=result.get('peak_mem_gib'),
    loss=result['loss'],
    device=jax.devices()[0].device_kind,
  )


def _check_reference(old, ref, *, after: bool, side: str) -> float:
  """The mean |old - ref| over completion tokens; at step 0 (B = 0) the reference (adapters off)
  must give the policy's log-probs, after the updates it must not.

  At step 0 the two are the same function but, on one side, two programs compiled apart (the
  LoRA path and the plain base): in bf16 over 32 layers of random weights their rounding
  reached 0.19 in one token's log-prob and 0.018 on average on the H200 (docs/benchmarks.md,
  LoRA SFT at 8B), so the check bounds the mean by bf16's reach there, 0.05, and prints the max.
  A reference that scored other tokens or other mask draws is off by far more.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  diff = np.abs(np.asarray(old, np.float64) - np.asarray(ref, np.float64))
  gap, worst = float(np.mean(diff)), float(np.max(diff))
  if not np.all(np.isfinite(old)) or not np.all(np.isfinite(ref)):
    raise SystemExit(f'{side}: non-finite log-probs')
  print(
    f'{side}: |policy - reference| {"after" if after else "at step 0"}: mean {gap:.3g}, '
    f'max {worst:.3g}',
    flush=True,
  )
  if not after and gap > 5e-2:
    raise SystemExit(f'{side}: the reference (adapters off) differs at step 0 by {gap:.3g}')
  if after and worst == 0.0:
    raise SystemExit(f'{side}: the updates left the policy equal to the reference')
  return gap


def _jax_rl(args) -> dict:
  """One d1 iteration: the rollout sampler, old / reference scoring, mu updates (the pieces
  rl/rollout.py composes, on random prompts, with random rewards)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlmjax import bench  # pylint: disable=import-outside-toplevel
  from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import distributed, rules  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import advantages as advantages_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import reference as reference_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import canvas, objectives  # pylint: disable=import-outside-toplevel
  from dlmjax.rl import rollout as rollout_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import stages  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  c = _jax_config(args, 'rl')
  d1, m = _d1(args.tiny), c.model
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
  step_fn = step_lib.CompiledStep(setup, stages.build(c))
  state = setup.init_state(c.seed)
  generate = sampler_programs.make_generate_fn(
    setup.model_config,
    sampling_config.SamplingConfig.from_config(c),
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
  )  # no mesh: one device, and a jitted function that compiles without running
  reference = reference_lib.ReferenceModel(c, setup)
  score_policy = rollout_lib.make_score_fn(c, setup.model_config)
  score_reference = rollout_lib.make_score_fn(c, reference.model_config)

  def score(fn, params, tokens, prompt_lengths, lengths, seeds_B):
    with rules.activation_mesh(setup.mesh):
      return distributed.to_host(fn(params, tokens, prompt_lengths, lengths, seeds_B))

  rng = np.random.default_rng(0)
  rows, group, mu = d1['rows'], d1['group'], d1['mu']
  prompts = [list(rng.integers(0, m.mask_token_id, d1['prompt'])) for _ in range(rows // group)]
  prompt_BP, prompt_lengths = prompt_rows.pad_prompts(
    [p for p in prompts for _ in range(group)], m.pad_token_id, width=d1['prompt']
  )
  key = jax.random.key(1)
  # Generate: compiled first, then timed.
  params = setup.model_params(state['params'])
  generate = generate.lower(params, prompt_BP, prompt_lengths, key).compile()
  start = time.perf_counter()
  out = distributed.to_host(generate(params, prompt_BP, prompt_lengths, key))
  generate_s = time.perf_counter() - start
  if (out[:, d1['prompt'] :] == m.mask_token_id).any():
    raise SystemExit('dlmjax: a completion kept a mask token')
  tokens, completion_mask, lengths = canvas.to_right_padded(
    out, prompt_lengths, d1['prompt'], eos_id=m.eos_token_id, pad_id=m.pad_token_id
  )
  seeds = np.stack([j * rows + np.arange(rows) for j in range(mu)]).astype(np.int32)
  # Score: the policy's and the reference's log-probs for every inner iteration's mask seeds.
  frozen = reference.params()
  score(score_policy, params, tokens, prompt_lengths, lengths, seeds[0])  # compiles both
  score(score_reference, frozen, tokens, prompt_lengths, lengths, seeds[0])
  start = time.perf_counter()
  old_all = [score(score_policy, params, tokens, prompt_lengths, lengths, s) for s in seeds]
  ref_all = [score(score_reference, frozen, tokens, prompt_lengths, lengths, s) for s in seeds]
  score_s = time.perf_counter() - start
  _check_reference(old_all[0], ref_all[0], after=False, side='dlmjax')
  # Update: mu optimizer steps on the rollout, each with its own seeds and old / ref estimates.
  rewards = rng.integers(0, 2, rows).astype(np.float32)
  common = dict(
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    lengths=lengths,
    advantages=advantages_lib.group_advantages(rewards, group),
    weight=objectives.get('d1').loss_weights(completion_mask),
    completion_mask=completion_mask,
    rewards=rewards,
  )

  def batch(j):
    arrays = dict(common, mask_seeds=seeds[j], old=old_all[j], ref=ref_all[j])
    return {k: jax.device_put(v, step_fn.batch_sharding) for k, v in arrays.items()}

  state, metrics = step_fn(state, batch(0))  # compiles
  jax.block_until_ready(metrics)
  timed = list(range(1, mu))[: args.timed_updates] or [0]
  start = time.perf_counter()
  for j in timed:
    state, metrics = step_fn(state, batch(j))
  jax.block_until_ready((state, metrics))
  update_s = (time.perf_counter() - start) / len(timed)
  loss = float(metrics['loss'])
  if not math.isfinite(loss):
    raise SystemExit(f'dlmjax: non-finite RL loss {loss}')
  after = score(
    score_policy, setup.model_params(state['params']), tokens, prompt_lengths, lengths, seeds[0]
  )
  gap = _check_reference(after, ref_all[0], after=True, side='dlmjax')
  peak = bench.peak_memory_bytes()
  return dict(
    task='rl',
    side='dlmjax (JAX)',
    generate_s=round(generate_s, 2),
    score_s=round(score_s, 2),
    update_s=round(update_s, 3),
    iteration_s=round(generate_s + score_s + mu * update_s, 1),
    peak_gib=None if peak is None else round(peak / 2**30, 1),
    loss=loss,
    policy_ref_gap=gap,
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


def _torch_model(shape, *, rank: int, alpha: float, seq_len: int, device: str, dropout=0.0):
  """A random bf16 LLaDA-shaped transformers Llama (bidirectional SDPA, no mask) with peft
  adapters on the seven projections and gradient checkpointing."""
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from benchmarks.peers import torch_sampler_peer  # pylint: disable=import-outside-toplevel

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
    max_position_embeddings=seq_len,
    tie_word_embeddings=False,
  )
  hf._attn_implementation = 'bidir_sdpa'  # bidirectional SDPA, no mask
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
  model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
  model.enable_input_require_grads()
  lora_config = peft.LoraConfig(
    r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=HF_TARGETS
  )
  return peft.get_peft_model(model, lora_config)  # adapters in float32 (autocast_adapter_dtype)


def _sync(device: str) -> None:
  import torch  # pylint: disable=import-outside-toplevel

  if device == 'cuda':
    torch.cuda.synchronize()


def _torch_peak(device: str):
  import torch  # pylint: disable=import-outside-toplevel

  return round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == 'cuda' else None


def _device_name(device: str) -> str:
  import torch  # pylint: disable=import-outside-toplevel

  return torch.cuda.get_device_name() if device == 'cuda' else 'cpu'


def _torch_sft(args) -> dict:
  import torch  # pylint: disable=import-outside-toplevel

  shape = _shape(args.tiny)
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  rank = RANK if not args.tiny else 8
  model = _torch_model(shape, rank=rank, alpha=ALPHA, seq_len=shape['seq_len'], device=device)
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

  loss = step()
  _check_peer_update(model, base_before)
  for _ in range(args.warmup):
    step()
  _sync(device)
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step()
  _sync(device)
  step_s = (time.perf_counter() - start) / args.steps
  loss = loss.detach()
  if not math.isfinite(float(loss)):
    raise SystemExit(f'peer: non-finite loss {float(loss)}')
  return dict(
    task='sft',
    side='transformers + peft (PyTorch)',
    tokens_per_s=round(rows * length / step_s),
    step_s=round(step_s, 4),
    peak_gib=_torch_peak(device),
    loss=float(loss),
    device=_device_name(device),
  )


def _check_peer_update(model, base_before) -> None:
  import torch  # pylint: disable=import-outside-toplevel

  layer = model.base_model.model.model.layers[0].self_attn.q_proj
  if not torch.equal(layer.base_layer.weight, base_before):
    raise SystemExit('peer: the base weight moved')
  if not layer.lora_B['default'].weight.abs().max() > 0:
    raise SystemExit('peer: the adapters did not move')


def _peer_token_logps(model, tokens, prompt: int, seed: int, mask_id: int):
  """d1's one-step estimate: prompt tokens masked w.p. p_mask_prompt (from `seed`), the whole
  completion masked, log p of each completion token [B, gen] in float32."""
  import torch  # pylint: disable=import-outside-toplevel

  generator = torch.Generator(device=tokens.device).manual_seed(seed)
  hidden = torch.rand(tokens.shape, device=tokens.device, generator=generator)
  masked = hidden < D1_OPT['p_mask_prompt']
  masked[:, prompt:] = True
  noisy = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
  logits = model(input_ids=noisy, use_cache=False).logits[:, prompt:]
  logp = torch.log_softmax(logits.float(), -1)
  return torch.gather(logp, -1, tokens[:, prompt:, None]).squeeze(-1)


def _torch_rl(args) -> dict:
  """One d1 iteration as d1's trainer runs it: LLaDA's generate loop, the old and the reference
  (disable_adapter) log-probs per mask seed, mu optimizer steps of 2 micro-batches."""
  import torch  # pylint: disable=import-outside-toplevel

  from benchmarks.peers import torch_sampler_peer  # pylint: disable=import-outside-toplevel

  shape, d1 = _shape(args.tiny), _d1(args.tiny)
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  width = d1['prompt'] + d1['gen']
  model = _torch_model(
    shape,
    rank=d1['rank'],
    alpha=d1['alpha'],
    seq_len=width,
    device=device,
    dropout=D1_OPT['dropout'],
  )
  trainable = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(
    trainable, lr=D1_OPT['lr'], betas=(0.9, D1_OPT['b2']), weight_decay=D1_OPT['weight_decay']
  )
  base_before = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
  rows, group, mu, mask_id = d1['rows'], d1['group'], d1['mu'], shape['mask_token_id']
  torch.manual_seed(0)
  prompt = torch.randint(0, mask_id, (rows // group, d1['prompt']), device=device)
  prompt = prompt.repeat_interleave(group, 0)
  model.eval()
  gen_args = (d1['gen'], d1['steps'], d1['block'], mask_id)
  torch_sampler_peer.generate(model, prompt, *gen_args, max_blocks=1)  # warm-up, same shapes
  _sync(device)
  start = time.perf_counter()
  tokens = torch_sampler_peer.generate(model, prompt, *gen_args)
  _sync(device)
  generate_s = time.perf_counter() - start
  if (tokens[:, d1['prompt'] :] == mask_id).any():
    raise SystemExit('peer: a completion kept a mask token')
  start = time.perf_counter()
  with torch.no_grad():
    old_all = [_peer_token_logps(model, tokens, d1['prompt'], j, mask_id) for j in range(mu)]
    with model.disable_adapter():
      ref_all = [_peer_token_logps(model, tokens, d1['prompt'], j, mask_id) for j in range(mu)]
  _sync(device)
  score_s = time.perf_counter() - start
  _check_reference(old_all[0].cpu().numpy(), ref_all[0].cpu().numpy(), after=False, side='peer')
  rewards = torch.randint(0, 2, (rows,), device=device).float()
  advantages = (rewards.view(-1, group) - rewards.view(-1, group).mean(1, keepdim=True)).view(-1)
  model.train()

  def update(j):
    for lo in range(0, rows, d1['micro']):
      hi = lo + d1['micro']
      logp = _peer_token_logps(model, tokens[lo:hi], d1['prompt'], j, mask_id)
      ratio = torch.exp(logp - old_all[j][lo:hi])
      a = advantages[lo:hi, None]
      clipped = torch.clamp(ratio, 1 - D1_OPT['eps'], 1 + D1_OPT['eps'])
      delta = ref_all[j][lo:hi] - logp
      kl = torch.exp(delta) - delta - 1
      loss = (-torch.minimum(ratio * a, clipped * a) + D1_OPT['beta'] * kl).sum() / tokens[
        :, d1['prompt'] :
      ].numel()
      loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, D1_OPT['clip'])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  loss = update(0)
  _check_peer_update(model, base_before)
  timed = list(range(1, mu))[: args.timed_updates] or [0]
  _sync(device)
  start = time.perf_counter()
  for j in timed:
    loss = update(j)
  _sync(device)
  update_s = (time.perf_counter() - start) / len(timed)
  if not math.isfinite(float(loss)):
    raise SystemExit(f'peer: non-finite RL loss {float(loss)}')
  model.eval()
  with torch.no_grad():
    after = _peer_token_logps(model, tokens, d1['prompt'], 0, mask_id)
  gap = _check_reference(after.cpu().numpy(), ref_all[0].cpu().numpy(), after=True, side='peer')
  return dict(
    task='rl',
    side='transformers + peft (PyTorch)',
    generate_s=round(generate_s, 2),
    score_s=round(score_s, 2),
    update_s=round(update_s, 3),
    iteration_s=round(generate_s + score_s + mu * update_s, 1),
    peak_gib=_torch_peak(device),
    loss=float(loss),
    policy_ref_gap=gap,
    device=_device_name(device),
  )


PARTS = dict(jax_sft=_jax_sft, torch_sft=_torch_sft, jax_rl=_jax_rl, torch_rl=_torch_rl)


def _run_part(part: str, args) -> dict:
  """One side in its own process; its last stdout line is its JSON result."""
  argv = [sys.executable, '-m', 'benchmarks.lora_8b', '--part', part]
  argv += ['--micro-batch', str(args.micro_batch), '--steps', str(args.steps)]
  argv += ['--warmup', str(args.warmup), '--remat', args.remat, '--base-dtype', args.base_dtype]
  argv += ['--timed-updates', str(args.timed_updates), '--cache', args.cache]
  argv += ['--tiny'] if args.tiny else []
  out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ), check=False)
  lines = [line for line in out.stdout.splitlines() if line.startswith('{')]
  if out.returncode or not lines:
    side = 'dlmjax (JAX)' if part.startswith('jax') else 'transformers + peft (PyTorch)'
    return dict(
      task=part.split('_')[1],
      side=side,
      error=f'exit {out.returncode}: {out.stdout.strip()[-300:]}',
    )
  return json.loads(lines[-1])


def _table(rows, args) -> str:
  shape, d1 = _shape(args.tiny), _d1(args.tiny)
  lines = [
    f'LoRA on {shape["num_layers"]} layers x d_model {shape["d_model"]}, targets {TARGETS}, '
    f'{args.base_dtype} base, remat {args.remat}',
    f'  sft: seq {shape["seq_len"]}, micro-batch {args.micro_batch}, rank '
    f'{RANK if not args.tiny else 8}, alpha {ALPHA:g}',
    f'  rl (d1): rank {d1["rank"]}, alpha {d1["alpha"]:g}, dropout {D1_OPT["dropout"]}, '
    f'{d1["rows"]} rows = '
    f'{d1["rows"] // d1["group"]} prompts x G {d1["group"]}, prompt {d1["prompt"]}, gen '
    f'{d1["gen"]}, block {d1["block"]}, {d1["steps"]} steps, mu {d1["mu"]}; iteration = generate '
    '+ score + mu x update',
    f'{"task":<4} {"side":<30} {"tokens/s":>9} {"gen s":>7} {"score s":>7} {"update s":>8} '
    f'{"iter s":>7} {"peak GiB":>8} {"loss":>8}',
  ]
  for r in rows:
    if 'error' in r:
      lines.append(f'{r["task"]:<4} {r["side"]:<30} failed: {r["error"]}')
      continue
    peak = '-' if r['peak_gib'] is None else f'{r["peak_gib"]:.1f}'
    if r['task'] == 'sft':
      cells = f'{r["tokens_per_s"]:>9,} {"-":>7} {"-":>7} {r["step_s"]:>8.3f} {"-":>7}'
    else:
      cells = (
        f'{"-":>9} {r["generate_s"]:>7.2f} {r["score_s"]:>7.2f} {r["update_s"]:>8.3f} '
        f'{r["iteration_s"]:>7.1f}'
      )
    lines.append(f'{r["task"]:<4} {r["side"]:<30} {cells} {peak:>8} {r["loss"]:>8.3f}')
  for task, key, better in (('sft', 'tokens_per_s', max), ('rl', 'iteration_s', min)):
    ok = [r for r in rows if r['task'] == task and 'error' not in r]
    if len(ok) == 2:
      jax_row, peer = ok
      speed = jax_row[key] / peer[key] if better is max else peer[key] / jax_row[key]
      lines.append(f'{task}: dlmjax / peer speed {speed:.2f}x')
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.lora_8b', description=__doc__)
  parser.add_argument('--tiny', action='store_true', help='a 2-layer model on CPU')
  parser.add_argument('--only', choices=('sft', 'rl', 'both'), default='both')
  # 80 GiB: micro-batch 4 with remat full is ~31 GiB by dlmjax.summary's estimate (8: ~39).
  parser.add_argument('--micro-batch', type=int, default=4, help='SFT rows per step')
  parser.add_argument('--steps', type=int, default=5, help='timed SFT steps')
  parser.add_argument('--warmup', type=int, default=1, help='untimed SFT steps')
  parser.add_argument(
    '--timed-updates', type=int, default=3, help='RL updates timed (of mu; the first compiles)'
  )
  parser.add_argument('--remat', default='full', help='dlmjax model.remat (peer: checkpointing)')
  parser.add_argument('--base-dtype', default='bfloat16', help='dlmjax train.lora.base_dtype')
  parser.add_argument(
    '--cache', default='none', help="dlmjax's rollouts: sampler.cache (none, prefix, dual)"
  )
  parser.add_argument('--part', choices=tuple(PARTS), default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.part:
    print(json.dumps(PARTS[args.part](args)), flush=True)
    return 0
  tasks = ('sft', 'rl') if args.only == 'both' else (args.only,)
  rows = [_run_part(f'{side}_{task}', args) for task in tasks for side in ('jax', 'torch')]
  for r in rows:
    print(json.dumps(r), flush=True)
  print(_table(rows, args), flush=True)
  return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
