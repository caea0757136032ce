"""python -m benchmarks.family_8b [--models llada_8b,dream_7b] [--tiny]

The open DLMs at their published sizes on one GPU, in bf16 with random weights: the forward
(batch 16 x 512 tokens) and the sampler (batch 16, prompt 64, gen 256, blocks of 32, 256 steps,
greedy low-confidence remasking) in tokens/s and peak memory, ours (JAX) beside a PyTorch peer in
the same process: transformers' class of the family (LlamaForCausalLM for LLaDA, whose blocks are
Llama's; Qwen2ForCausalLM for Dream, its logits shifted as Dream's generate does) with
bidirectional SDPA (is_causal off, no mask) under torch.compile, running LLaDA's generate loop
(both from benchmarks/peers/torch_sampler_peer.py). The peer gets OUR weights
(hf_mapping.export_tensors, bf16), so its logits are checked against ours first: the two must
compute one function before their speeds compare (max |dlogit| / max |logit| printed).

Both sides hold bf16 weights. The peer runs first and frees its memory (torch's cache is
emptied); then ours runs in a child process that never loads torch (`--own-process parent`, the
default: beside torch in one process our 8B forward ran at 0.84x its speed alone), and JAX does
not preallocate, so each peak is its own. With `--own-process '' --forward-only --rounds N` the
peer stays and the two forwards alternate N times in this process (each keeps its best round).
On the H200 (docs/benchmarks.md, "8B families"), one model per command (each takes minutes):
    python -m benchmarks.family_8b --models llada_8b
    python -m benchmarks.family_8b --models dream_7b
On CPU, the same code at toy sizes (no torch.compile):
    python -m benchmarks.family_8b --tiny
"""

from __future__ import annotations

import os

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # before JAX starts: see above

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dlmjax import config as config_lib  # noqa: E402
from dlmjax import model as model_lib  # noqa: E402
from dlmjax.checkpoint import hf_config  # noqa: E402
from dlmjax.checkpoint import hf_mapping  # noqa: E402
from dlmjax.diffusion import sampler_programs, sampling_config  # noqa: E402
from dlmjax.model import programs  # noqa: E402

_TINY = dict(num_layers=2, d_model=128, num_heads=4, head_dim=32, ffn_dim=256, vocab_size=512)
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  seq: int
  prompt: int
  gen: int
  block: int
  steps: int
  repeats: int
  rounds: int = 1


FULL = Shape(batch=16, seq=512, prompt=64, gen=256, block=32, steps=256, repeats=2)
TINY = Shape(batch=2, seq=32, prompt=8, gen=16, block=8, steps=16, repeats=1)


def model_config(name: str, tiny: bool):
  """A dlmjax config of the preset `name` in bf16 (shrunk, same options, for --tiny)."""
  config = config_lib.defaults()
  if name not in model_lib.PRESETS:
    raise ValueError(f'unknown model {name!r}; known: {sorted(model_lib.PRESETS)}.')
  model_lib.apply_preset(config.model, name)
  if tiny:
    kv = 4 if config.model.num_kv_heads == config.model.num_heads else 2
    config.model.update(_TINY, num_kv_heads=kv, mask_token_id=500, eos_token_id=2, pad_token_id=2)
  config.model.dtype = 'bfloat16'
  config.model.seq_len = max(FULL.seq, FULL.prompt + FULL.gen)
  config_lib.validate(config, num_devices=1)
  return config


# ----------------------------------------------------------------------------------------------
# Ours


def _peak_gib(device) -> float:
  stats = device.memory_stats() or {}
  return stats.get('peak_bytes_in_use', 0) / _GIB


def _best(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def _forward_tok_s(forward, params, tokens, shape: Shape) -> float:
  jax.block_until_ready(forward(params, tokens))
  return shape.batch * shape.seq / _best(lambda: forward(params, tokens), shape.repeats)


def run_ours(config, params, shape: Shape, tokens, prompt) -> dict:
  """The forward twice: as training runs it (the stored layout, float32 logits) and as an
  inference program runs it (model.inference_module's layout made once: q / k / v and gate / up
  fused; the decode compiler options; logits in bf16, which nothing here reads as
  probabilities); then the sampler."""
  cfg = model_lib.ModelConfig.from_config(config)
  m = config.model
  device = jax.devices()[0]
  forward = jax.jit(lambda p, t: model_lib.merge(cfg, p)(t))
  train_tok_s = _forward_tok_s(forward, params, tokens, shape)
  forward_peak = _peak_gib(device)
  fused_cfg = model_lib.inference_config(cfg)
  fused = jax.block_until_ready(jax.jit(lambda p: model_lib.computed_params(cfg, p))(params))
  forward = programs.jit_program(
    lambda p, t: model_lib.merge(fused_cfg, p)(t, logits_dtype=jnp.bfloat16),
    cfg.matmul_dtype,
    decode=True,
  )
  inference_tok_s = _forward_tok_s(forward, fused, tokens, shape)
  del fused
  if not shape.gen:  # --forward-only
    return dict(
      forward_tok_s=max(train_tok_s, inference_tok_s),
      train_forward_tok_s=train_tok_s,
      inference_forward_tok_s=inference_tok_s,
      sampler_tok_s=float('nan'),
      forward_peak_gib=forward_peak,
      peak_gib=_peak_gib(device),
    )
  sampling = sampling_config.SamplingConfig(
    gen_length=shape.gen, steps=shape.steps, block_length=shape.block, temperature=0.0
  )
  generate = sampler_programs.make_generate_fn(
    cfg,
    sampling,
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
  )
  lengths = jnp.full((shape.batch,), shape.prompt, jnp.int32)
  jax.block_until_ready(generate(params, prompt, lengths, jax.random.key(0)))
  sample_s = _best(lambda: generate(params, prompt, lengths, jax.random.key(1)), shape.repeats)
  return dict(
    forward_tok_s=max(train_tok_s, inference_tok_s),
    train_forward_tok_s=train_tok_s,
    inference_forward_tok_s=inference_tok_s,
    sampler_tok_s=shape.batch * shape.gen / sample_s,
    forward_peak_gib=forward_peak,
    peak_gib=_peak_gib(device),
  )


# ----------------------------------------------------------------------------------------------
# The PyTorch peer


def torch_peer(config, params, *, device: str, compile_model: bool):
  """transformers' class of the family over our weights (bf16), bidirectional SDPA."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from benchmarks.peers import torch_sampler_peer  # pylint: disable=import-outside-toplevel

  cfg = model_lib.ModelConfig.from_config(config)
  # Dream's blocks are Qwen2's: the peer is Qwen2 with Dream's shift applied to its logits.
  family = hf_config.export_family(qk_norm=cfg.qk_norm, qkv_bias=cfg.qkv_bias)
  hf = hf_config.to_hf(config, vocab_rows=cfg.vocab_size, dtype='bf16', family=family)
  config_class = {'llama': 'LlamaConfig', 'qwen2': 'Qwen2Config', 'qwen3': 'Qwen3Config'}[family]
  hf_cfg = getattr(transformers, config_class)(**hf)
  transformers.AttentionInterface.register('bidir_sdpa', torch_sampler_peer.bidirectional_sdpa)
  hf_cfg._attn_implementation = 'bidir_sdpa'  # pylint: disable=protected-access
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(device):
    model = getattr(transformers, hf['architectures'][0])(hf_cfg).eval()
  torch.set_default_dtype(torch.float32)
  state = model.state_dict()
  with torch.no_grad():
    for name, array in hf_mapping.export_tensors(
      params, cfg, vocab_rows=cfg.vocab_size, names=family
    ):
      state[name].copy_(torch.from_numpy(array))
  if compile_model:
    model.forward = torch.compile(model.forward)
  return _Shifted(model) if cfg.shift_logits else model


class _Shifted:
  """Dream's output convention on a transformers model: position i reads the logits of i - 1
  (position 0 its own), as Dream's generate shifts them."""

  def __init__(self, model):
    self.model = model

  def __call__(self, tokens):
    import torch  # pylint: disable=import-outside-toplevel

    out = self.model(tokens)
    out.logits = torch.cat([out.logits[:, :1], out.logits[:, :-1]], dim=1)
    return out


def run_peer(model, config, shape: Shape, tokens, prompt, device: str) -> dict:
  import torch  # pylint: disable=import-outside-toplevel

  from benchmarks.peers import torch_sampler_peer  # pylint: disable=import-outside-toplevel

  cuda = device == 'cuda'

  def sync():
    if cuda:
      torch.cuda.synchronize()

  def best(fn):
    times = []
    for _ in range(shape.repeats):
      sync()
      start = time.perf_counter()
      fn()
      sync()
      times.append(time.perf_counter() - start)
    return min(times)

  t = torch.as_tensor(np.asarray(tokens), device=device)
  p = torch.as_tensor(np.asarray(prompt), dtype=torch.long, device=device)
  with torch.no_grad():
    model(t).logits  # pylint: disable=expression-not-assigned  # compile
    forward_s = best(lambda: model(t).logits)
    forward_peak = torch.cuda.max_memory_allocated() / _GIB if cuda else 0.0
    mask = config.model.mask_token_id
    args = (shape.gen, shape.steps, shape.block, mask)
    sample_s = float('nan')  # --forward-only
    if shape.gen:
      torch_sampler_peer.generate(model, p, *args, max_blocks=1)  # compile the sampler's shape
      sample_s = best(lambda: torch_sampler_peer.generate(model, p, *args))
  return dict(
    forward_tok_s=shape.batch * shape.seq / forward_s,
    sampler_tok_s=shape.batch * shape.gen / sample_s,
    forward_peak_gib=forward_peak,
    peak_gib=torch.cuda.max_memory_allocated() / _GIB if cuda else 0.0,
  )


def logits_error(config, params, model, tokens, device: str) -> float:
  """max |ours - peer| / max |ours| over the logits of a few rows: one function, or stop."""
  import torch  # pylint: disable=import-outside-toplevel

  cfg = model_lib.ModelConfig.from_config(config)
  ours = np.asarray(jax.jit(lambda p, t: model_lib.merge(cfg, p)(t))(params, tokens), np.float32)
  with torch.no_grad():
    theirs = model(torch.as_tensor(np.asarray(tokens), device=device)).logits.float().cpu().numpy()
  return float(np.abs(ours - theirs).max() / np.abs(ours).max())


# ----------------------------------------------------------------------------------------------


def _ours_in_own_process(name: str, shape: Shape, *, tiny: bool) -> dict:
  """run_ours's figures from a child process that never loads torch (the same weights: the
  same key draws them). Beside torch in one process our 8B forward ran 0.84x as fast as alone
  (docs/benchmarks.md, 8B families)."""
  cmd = [sys.executable, '-m', 'benchmarks.family_8b', '--models', name, '--own-process', 'child']
  cmd += ['--repeats', str(shape.repeats)] + (['--tiny'] if tiny else [])
  cmd += [] if shape.gen else ['--forward-only']
  out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
  row = json.loads(out.strip().splitlines()[-1])
  row.pop('model')
  return row


def bench(
  name: str, shape: Shape, *, tiny: bool, device: str, compile_model: bool, own_process: str = ''
) -> list[dict]:
  """own_process: '' both sides in this process; 'parent' ours from a child process;
  'child' ours only (the child's part)."""
  if own_process != 'child':
    import torch  # pylint: disable=import-outside-toplevel

  config = model_config(name, tiny)
  cfg = model_lib.ModelConfig.from_config(config)
  # Cast inside the jit: the float32 draw never exists whole (8B x 4 bytes), only per tensor.
  init = jax.jit(
    lambda key: jax.tree.map(lambda x: x.astype(jnp.bfloat16), model_lib.init_params(cfg, key))
  )
  params = jax.block_until_ready(init(jax.random.key(0)))
  rng = np.random.default_rng(0)
  m = config.model
  special = {m.mask_token_id, m.eos_token_id, m.pad_token_id}
  choices = np.array([t for t in range(min(m.vocab_size, 1000)) if t not in special])
  tokens = jnp.asarray(rng.choice(choices, (shape.batch, shape.seq)), jnp.int32)
  prompt = jnp.asarray(rng.choice(choices, (shape.batch, shape.prompt)), jnp.int32)

  if own_process == 'child':  # ours alone: this process never loads torch
    return [dict(model=name, **run_ours(config, params, shape, tokens, prompt))]
  peer = torch_peer(config, params, device=device, compile_model=compile_model)
  error = logits_error(config, params, peer, tokens[:2, :128], device)
  theirs = run_peer(peer, config, shape, tokens, prompt, device)
  if shape.gen or shape.rounds <= 1:
    del peer
    if device == 'cuda':
      torch.cuda.empty_cache()
  if own_process == 'parent':
    del params
    ours = _ours_in_own_process(name, shape, tiny=tiny)
  else:
    ours = run_ours(config, params, shape, tokens, prompt)
  for _ in range(1, 1 if shape.gen else shape.rounds):
    # Forward only, side by side: the two alternate in one process, so clocks, heat and the
    # other side's allocations weigh on both; each side keeps its best round.
    again = run_peer(peer, config, shape, tokens, prompt, device)
    theirs['rounds'] = theirs.get('rounds', [theirs['forward_tok_s']]) + [again['forward_tok_s']]
    theirs['forward_tok_s'] = max(theirs['rounds'])
    more = run_ours(config, params, shape, tokens, prompt)
    ours['rounds'] = ours.get('rounds', [ours['inference_forward_tok_s']]) + [
      more['inference_forward_tok_s']
    ]
    for key in ('forward_tok_s', 'train_forward_tok_s', 'inference_forward_tok_s'):
      ours[key] = max(ours[key], more[key])
  params_b = cfg.num_params() / 1e9
  peer_name = 'transformers ' + ('+ compile' if compile_model else 'eager')
  return [
    dict(model=name, impl='dlmjax (jax)', params_b=params_b, rel_err=error, **ours),
    dict(model=name, impl=peer_name, params_b=params_b, rel_err=error, **theirs),
  ]


def table(rows: list[dict]) -> str:
  head = (
    f'{"model":10} {"impl":24} {"params":>7} {"fwd tok/s":>11} {"sampler tok/s":>14} '
    f'{"fwd peak GiB":>13} {"peak GiB":>9} {"fwd vs peer":>12} {"vs peer":>8} {"logit err":>10}'
  )
  lines = [head, '-' * len(head)]
  for i in range(0, len(rows), 2):
    for row in rows[i : i + 2]:
      speed = row['sampler_tok_s'] / rows[i + 1]['sampler_tok_s']
      forward = row['forward_tok_s'] / rows[i + 1]['forward_tok_s']
      lines.append(
        f'{row["model"]:10} {row["impl"]:24} {row["params_b"]:6.2f}B '
        f'{row["forward_tok_s"]:11.1f} {row["sampler_tok_s"]:14.1f} '
        f'{row["forward_peak_gib"]:13.1f} {row["peak_gib"]:9.1f} {forward:11.2f}x {speed:7.2f}x '
        f'{row["rel_err"]:10.2e}'
      )
    ours = rows[i]
    if 'train_forward_tok_s' in ours:  # the forward's two programs (run_ours)
      lines.append(
        f'{"":10} dlmjax forward as trained {ours["train_forward_tok_s"]:.1f} tok/s, as an '
        f'inference program {ours["inference_forward_tok_s"]:.1f} tok/s'
      )
    if 'rounds' in ours:
      lines.append(
        f'{"":10} rounds (inference forward tok/s): dlmjax '
        f'{", ".join(f"{v:.0f}" for v in ours["rounds"])}; peer '
        f'{", ".join(f"{v:.0f}" for v in rows[i + 1]["rounds"])}'
      )
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.family_8b',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--models', default='llada_8b,dream_7b')
  parser.add_argument('--tiny', action='store_true', help='toy sizes on CPU (no torch.compile)')
  parser.add_argument('--no-compile', action='store_true', help='the peer without torch.compile')
  parser.add_argument(
    '--max-rel-err', type=float, default=0.1, help='bf16 logits agreement (LLaDA-8B: 0.059)'
  )
  parser.add_argument('--repeats', type=int, default=0, help='timed runs, best kept (default 2)')
  parser.add_argument('--forward-only', action='store_true', help='no sampler rows (nan)')
  parser.add_argument(
    '--own-process',
    choices=('', 'parent', 'child'),
    default='parent',
    help="ours timed in a child process that never loads torch (default; '' both in this one)",
  )
  parser.add_argument(
    '--rounds',
    type=int,
    default=1,
    help='with --forward-only: time peer and ours alternately this many times (best of each)',
  )
  args = parser.parse_args(argv)
  shape = TINY if args.tiny else FULL
  if args.forward_only:
    shape = dataclasses.replace(shape, gen=0)
  if args.repeats:
    shape = dataclasses.replace(shape, repeats=args.repeats)
  if args.rounds > 1:
    if not args.forward_only:
      parser.error('--rounds needs --forward-only (the sampler rows run once)')
    if args.own_process:
      parser.error("--rounds alternates both sides in one process: give --own-process ''")
    shape = dataclasses.replace(shape, rounds=args.rounds)
  device = 'cpu' if args.tiny else 'cuda'
  rows = []
  try:
    for name in [n.strip() for n in args.models.split(',') if n.strip()]:
      rows += bench(
        name,
        shape,
        tiny=args.tiny,
        device=device,
        compile_model=not (args.tiny or args.no_compile),
        own_process=args.own_process,
      )
      if args.own_process == 'child':
        print(json.dumps(rows[-1]), flush=True)
        return 0
      print(rows[-2], rows[-1], sep='\n', flush=True)
      if rows[-1]['rel_err'] > args.max_rel_err:
        raise ValueError(
          f'{name}: the peer computes another function (logit error {rows[-1]["rel_err"]:.3g} > '
          f'{args.max_rel_err}); the speeds would not compare.'
        )
  except (ValueError, config_lib.ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(
    f'\n{jax.devices()[0].device_kind}, bf16 weights, forward {shape.batch}x{shape.seq}, sampler '
    f'{shape.batch} x gen {shape.gen} (prompt {shape.prompt}, block {shape.block}, '
    f"{shape.steps} steps); vs peer = sampler tokens/s over the peer's"
  )
  print(table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
