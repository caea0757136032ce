"""python -m dlmjax.verify --checkpoint-path P [--hf-dir D] [--dtype fp32|bf16]

Two questions about a checkpoint. Integrity: is every array its config implies there, with the
right shape and dtype, finite, matching its saved checksum, with optimizer state shaped like the
params? Parity: does a PyTorch forward of the converted weights (transformers' class of the
export's family, Qwen3, Qwen2 or Llama, loaded through the modeling_dlmjax.py every export ships,
as a user loads it: AutoModelForCausalLM with trust_remote_code; else
dlmjax.checkpoint.torch_reference) give our JAX forward's logits on the same random masked
tokens? MegaDLMs' verify_correctness_dlm.py prints differences without a threshold; we pass or fail.
A LoRA run's integrity checks are of its adapters; its base is restored and checked against the
run's record, and parity runs on the merged model (checkpoint/run_model.py).
Exit 0 when every check passes, 1 otherwise.

Tolerances, relative to max(1, max |logit|) and to max(1, masked CE), with what we measured on
the 1.7B shape (random weights, transformers on an H200, 2x128 / 4x512 tokens):
  fp32: 1e-4 for both. Measured 5e-6 (max |dlogit| 2.6e-5 at max |logit| 5.1) and 1.5e-8 (CE).
        TF32 is off on both sides; with it on, this check would fail, as it should.
  bf16: 1e-1 for logits, 1e-2 for CE. Measured 2.5e-2 (max |dlogit| 0.12, mean 0.018) and 1e-4.
        Both sides round activations to bf16 at different points (torch after each op, XLA after
        fused ones), so single logits drift; the CE over many tokens averages that out. bf16 is
        a smoke test; judge a conversion by fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax import extras
from dlmjax import model as model_lib
from dlmjax.checkpoint import checksums
from dlmjax.checkpoint import families
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import lora_checkpoint
from dlmjax.checkpoint import manager
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import run_model
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from dlmjax.model import lora
from dlmjax.parallel import distributed
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.train import state as state_lib

TOLERANCES = {'fp32': (1e-4, 1e-4), 'bf16': (1e-1, 1e-2)}  # (logits, masked CE)
_COMPUTE = {'fp32': 'float32', 'bf16': 'bfloat16'}


@dataclasses.dataclass
class Check:
  name: str
  ok: bool
  detail: str


def _flat(tree) -> dict:
  """{'a/b/c': leaf} of a nested dict / orbax metadata tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path): leaf
    for path, leaf in leaves
  }


def _metadata(item_dir: str) -> dict:
  return _flat(params_checkpoint.item_metadata(item_dir))


# ----------------------------------------------------------------------------------------------
# Integrity


def stored_params(config):
  """The params a step of this run holds, as ShapeDtypeStructs: the whole model, or a LoRA run's
  adapters alone (its base lives where lora_base.json says)."""
  cfg = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  shapes = model_lib.abstract(cfg)[1]
  return lora.split(shapes)[0] if lora.is_lora_run(config) else shapes


def _check_params_metadata(step_dir, shapes) -> Check:
  expected = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _flat(shapes).items()}
  try:
    saved = {
      k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _metadata(f'{step_dir}/params').items()
    }
  except (OSError, ValueError, KeyError) as e:
    return Check('params present', False, f'cannot read {step_dir}/params ({e}); half-written?')
  if not saved:
    return Check(
      'params present',
      False,
      f'no arrays readable in {step_dir}/params: the checkpoint is half-written or corrupt.',
    )
  problems = [f'{k} missing' for k in sorted(set(expected) - set(saved))]
  problems += [f'{k} not in the model' for k in sorted(set(saved) - set(expected))]
  problems += [
    f'{k}: saved {saved[k][0]} {saved[k][1]}, config implies {v[0]} {v[1]}'
    for k, v in sorted(expected.items())
    if k in saved and saved[k] != v
  ]
  return Check(
    'params present',
    not problems,
    '; '.join(problems) or f'{len(expected)} arrays with the shapes and dtypes of the config',
  )


def _saved_items(meta, step_dir) -> tuple[str, ...]:
  """The array items this checkpoint holds, by every record of them (checksums, the layout, a
  directory): params, and opt_state (and RL's reference) in a training checkpoint; an import or
  export holds params only."""
  named = {k[: -len('_checksums')] for k in meta if k.endswith('_checksums')}
  named |= {k.split('/')[0] for k in meta.get('layout') or {}}
  named |= {k for k in ('opt_state', 'reference') if os.path.isdir(os.path.join(step_dir, k))}
  return ('params',) + tuple(sorted(named - {'params'}))


def _check_opt_state(step_dir, shapes, meta) -> Check:
  """Every param-shaped subtree of the optimizer state (Adam's mu, nu) covers all params."""
  params = {k: tuple(v.shape) for k, v in _flat(shapes).items()}
  if not os.path.isdir(f'{step_dir}/opt_state'):
    if 'opt_state' in _saved_items(meta, step_dir):
      return Check(
        'optimizer state',
        False,
        f'{step_dir}/opt_state is missing, but the meta records its checksums: the item was '
        'deleted or lost (this is a training checkpoint, not a params-only one).',
      )
    return Check('optimizer state', True, 'none saved (params-only checkpoint)')
  try:
    opt = {k: tuple(v.shape) for k, v in _metadata(f'{step_dir}/opt_state').items()}
  except (OSError, ValueError, KeyError) as e:
    return Check('optimizer state', False, f'cannot read opt_state ({e}); half-written?')
  prefixes = {k[: -len(p)] for k in opt for p in params if k == p or k.endswith('/' + p)}
  problems = []
  for prefix in sorted(prefixes):
    for p, shape in params.items():
      if opt.get(prefix + p) != shape:
        problems.append(f'{prefix}{p}: {opt.get(prefix + p, "missing")}, param {shape}')
  ok = not problems
  return Check(
    'optimizer state',
    ok,
    '; '.join(problems[:8])
    if problems
    else f'{len(prefixes)} param-shaped subtrees ({", ".join(sorted(prefixes))}) match',
  )


def _check_checksums(meta, params) -> Check:
  saved = step_meta.saved_checksums(meta)
  if saved is None and step_meta.predates_checksums(meta):
    return Check('checksums', True, 'the checkpoint predates checksums; skipped')
  if saved is None:
    return Check('checksums', False, 'the meta has no params checksums in this format (damaged)')
  problems = checksums.compare(saved, checksums.compute(params))
  return Check('checksums', not problems, '; '.join(problems[:8]) or f'{len(saved)} digests match')


@jax.jit
def _all_finite(params):
  """Per leaf, whether every element is finite: one program for the whole tree (not two per
  leaf shape), where each shard lives."""
  return jax.tree.map(lambda v: jnp.isfinite(v).all(), params)


def check_integrity(step_dir: str, config, step: int):
  """(checks, params or None) of a step directory."""
  shapes = stored_params(config)
  checks = [_check_params_metadata(step_dir, shapes)]
  if not checks[0].ok:
    return checks, None
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  params = params_checkpoint.restore_params(
    step_dir, shapes, jax.tree.map(lambda _: device, shapes)
  )
  finite = _all_finite(params)
  bad = [k for k, v in _flat(finite).items() if not bool(v)]
  checks.append(
    Check(
      'params finite', not bad, 'non-finite values in ' + ', '.join(bad) if bad else 'no NaN or inf'
    )
  )
  try:
    meta = step_meta.read_meta(step_dir)
  except (run_dir_lib.CheckpointError, ValueError) as e:
    return checks + [Check('step metadata', False, str(e))], params
  checks += [
    _check_checksums(meta, params),
    _check_opt_state(step_dir, shapes, meta),
    _check_step_meta(meta, step, _saved_items(meta, step_dir)),
  ]
  if 'opt_state' in _saved_items(meta, step_dir) and checks[-2].ok:
    checks.append(_check_as_resume_reads(step_dir, config, step))
  return checks, params


def _check_step_meta(meta, step, items) -> Check:
  """The meta item as resume tests it (step_meta.check_meta): its step, the data state's sha256,
  every integrity key a checksummed checkpoint must hold."""
  try:
    verified = step_meta.check_meta(meta, step, items=items)
  except step_meta.DamagedCheckpoint as e:
    return Check('step metadata', False, str(e))
  detail = f'step {step}; ' + (
    'step and data state match their checksum' if verified else 'predates checksums'
  )
  return Check('step metadata', True, detail)


def _check_as_resume_reads(step_dir, config, step) -> Check:
  """A training checkpoint read back as a resume reads it (RunCheckpoints.restore, on one
  device): every item's arrays (params, optimizer state, RL's reference) against their
  checksums, and the step and data state against theirs."""
  config = config_lib.from_dict(config.to_dict())
  for axis in config_lib.MESH_AXES:  # the stored shapes never depend on the mesh
    config.mesh[axis] = 1
  config.mesh.pipeline_repeats = 1
  try:
    setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config, jax.local_devices()[:1]))
    checkpoints = manager.RunCheckpoints(os.path.dirname(os.path.dirname(step_dir)), read_only=True)
    try:
      state, _ = checkpoints.restore(step, setup)
    finally:
      checkpoints.close()
  except (step_meta.DamagedCheckpoint, run_dir_lib.CheckpointError) as e:
    return Check('saved state, as resume reads it', False, str(e))
  items = ', '.join(k for k in state if k != 'step')
  return Check(
    'saved state, as resume reads it',
    True,
    f'{items} match their checksums; so do step and data state',
  )


# ----------------------------------------------------------------------------------------------
# Parity


def _round_to(params, dtype):
  return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype).astype(jnp.float32), params)


def check_hf_weights(hf_dir: str, params, config) -> Check:
  """Every tensor in hf_dir equals ours, rounded to the file's dtype: by name against our export
  where hf_dir has the export's names (Qwen3, Qwen2, Llama), else (LLaDA, SDAR, ...) imported
  through the family's own names and compared array by array."""
  cfg = model_lib.ModelConfig.from_config(config)
  hf = hf_config.read(hf_dir)
  arch = hf_config.detect_architecture(hf)
  naming = hf_mapping.NAMINGS[hf_mapping.export_family(cfg)]
  if hf_mapping.NAMINGS[arch] != naming:
    return _check_source_weights(hf_dir, hf, arch, params, config)
  reader = safetensors_io.SafetensorsReader(hf_dir)
  rows = reader.shape(naming.embed)[0]
  problems = []
  for name, ours in hf_mapping.export_tensors(
    params, cfg, vocab_rows=rows, to_host=distributed.to_host
  ):
    if name not in reader:
      problems.append(f'{name} missing')
      continue
    theirs = reader.get(name)
    if theirs.shape != ours.shape:
      problems.append(f'{name}: shape {theirs.shape}, ours {ours.shape}')
    elif np.any(ours.astype(theirs.dtype).astype(np.float32) != theirs.astype(np.float32)):
      diff = np.abs(ours - theirs.astype(np.float32)).max()
      problems.append(f'{name}: differs (max |diff| {diff:.3g})')
  return Check(
    'exported weights',
    not problems,
    '; '.join(problems[:8]) or f'every tensor equals ours in {reader.dtype(naming.embed)}',
  )


def _check_source_weights(hf_dir: str, hf: dict, arch: str, params, config) -> Check:
  """hf_dir's tensors read through its family's names (hf_mapping.import_params, which refuses
  a missing or unknown tensor) equal our params rounded to the file's dtype."""
  reader = safetensors_io.SafetensorsReader(hf_dir)
  dtype = reader.dtype(hf_mapping.NAMINGS[arch].embed)
  try:
    theirs = _flat(hf_io.params_from_source(reader, hf, config))
  except hf_mapping.MappingError as e:
    return Check('source weights', False, str(e))
  ours = _flat(_round_to(params, jnp.dtype(dtype)))
  problems = []
  for key, mine in ours.items():
    other = np.asarray(theirs[key], np.float32)
    mine = np.asarray(mine, np.float32)
    if other.shape != mine.shape:
      problems.append(f'{key}: {arch} tensors give {other.shape}, ours {mine.shape}')
    elif np.any(other != mine):
      problems.append(f'{key}: differs (max |diff| {np.abs(other - mine).max():.3g})')
  return Check(
    'source weights',
    not problems,
    '; '.join(problems[:8])
    or f"every {arch} tensor, read through {arch}'s names, equals ours in {dtype}",
  )


def _masked_ce(logits_BLV, targets_BL, mask_BL) -> float:
  x = logits_BLV.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets_BL[..., None], -1)[..., 0]
  return float((nll * mask_BL).sum() / mask_BL.sum())


def torch_logits(hf_dir: str, tokens_BL: np.ndarray, dtype: str, backend: str = 'auto'):
  """(float32 logits, description) of the PyTorch forward of an exported directory (on a GPU
  when torch sees one)."""
  import torch  # pylint: disable=import-outside-toplevel
  from dlmjax.checkpoint import torch_reference  # pylint: disable=import-outside-toplevel

  torch_dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16}[dtype]
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  if backend == 'auto':
    has_transformers = importlib.util.find_spec('transformers') is not None
    # A family whose classes are remote code transformers does not ship (Dream, SDAR) checks on
    # Reference (Family.parity).
    family = families.detect(hf_config.read(hf_dir))
    in_transformers = has_transformers and family.parity == 'transformers'
    backend = 'transformers' if in_transformers else 'reference'
  tokens = torch.as_tensor(tokens_BL, dtype=torch.long, device=device)
  with torch.no_grad():
    if backend == 'transformers':
      model = torch_reference.transformers_model(hf_dir, torch_dtype).to(device)
      logits = model(input_ids=tokens, use_cache=False).logits
    else:
      reader = safetensors_io.SafetensorsReader(hf_dir)
      state = {k: torch.from_numpy(reader.get(k).astype(np.float32)) for k in reader.keys()}
      model = torch_reference.Reference(hf_config.read(hf_dir), state, torch_dtype, device)
      logits = model(tokens)
  return logits.float().cpu().numpy(), f'{backend} on {device}'


def check_parity(
  params,
  config,
  hf_dir: str,
  *,
  dtype: str = 'fp32',
  batch: int = 2,
  length: int = 0,
  seed: int = 0,
  backend: str = 'auto',
) -> list[Check]:
  """Our JAX logits vs the PyTorch forward of hf_dir on random tokens, about half masked."""
  m = config.model
  length = length or min(m.seq_len, 128)
  rng = np.random.default_rng(seed)
  targets = rng.integers(0, m.vocab_size, (batch, length))
  mask = rng.random((batch, length)) < 0.5
  mask[:, 0] |= ~mask.any(1)  # at least one masked token per row, as the training loss does.
  tokens = np.where(mask, m.mask_token_id, targets)

  file_dtype = safetensors_io.SafetensorsReader(hf_dir).dtype('model.embed_tokens.weight')
  if file_dtype != np.float32:  # compare the mapping, not the export's rounding.
    params = _round_to(params, jnp.dtype(file_dtype))
  cfg = dataclasses.replace(
    model_lib.ModelConfig.from_config(config),
    dtype=_COMPUTE[dtype],
    attention_backend='xla',
    norm_backend='xla',
  )
  with jax.default_matmul_precision('highest' if dtype == 'fp32' else 'default'):  # no TF32
    forward = jax.jit(lambda p, t: model_lib.merge(cfg, p)(t))
    ours = np.asarray(forward(params, tokens), np.float32)
  theirs, used = torch_logits(hf_dir, tokens, dtype, backend)
  columns = min(ours.shape[-1], theirs.shape[-1])
  ours, theirs = ours[..., :columns], theirs[..., :columns]
  logit_tol, ce_tol = TOLERANCES[dtype]
  max_diff = float(np.abs(ours - theirs).max())
  scale = max(1.0, float(np.abs(theirs).max()))
  ce_ours, ce_theirs = _masked_ce(ours, targets, mask), _masked_ce(theirs, targets, mask)
  ce_diff = abs(ce_ours - ce_theirs)
  where = f'{used}, {dtype}, {batch}x{length} tokens, {int(mask.sum())} masked'
  return [
    Check(
      'logits parity',
      max_diff <= logit_tol * scale,
      f'max |dlogit| {max_diff:.3g} (max |logit| {scale:.3g}, tolerance '
      f'{logit_tol:g} x that; mean |dlogit| {np.abs(ours - theirs).mean():.3g}) [{where}]',
    ),
    Check(
      'masked CE parity',
      ce_diff <= ce_tol * max(1.0, ce_theirs),
      f'CE ours {ce_ours:.6f}, torch {ce_theirs:.6f}, |diff| {ce_diff:.3g} '
      f'(tolerance {ce_tol:g} relative)',
    ),
  ]


# ----------------------------------------------------------------------------------------------
# Driver


def verify(
  checkpoint_path: str,
  *,
  hf_dir: str | None = None,
  dtype: str = 'fp32',
  parity: bool = True,
  **parity_kwargs,
) -> list[Check]:
  """Every check on one checkpoint; parity exports to a temporary directory unless hf_dir."""
  try:
    run_dir, step_dir, step = run_dir_lib.resolve_step_dir(checkpoint_path)
    config = run_dir_lib.load_run_config(run_dir)
  except run_dir_lib.CheckpointError as e:
    return [Check('checkpoint found', False, str(e))]
  checks = [Check('checkpoint found', True, f'{step_dir} (step {step})')]
  try:
    more, params = check_integrity(step_dir, config, step)
  except Exception as e:  # pylint: disable=broad-except  # any unreadable array is a finding.
    return checks + [Check('params readable', False, f'{type(e).__name__}: {e}')]
  checks += more
  if params is None:
    return checks
  if lora.is_lora_run(config):  # the base it names, joined to the adapters (parity's model)
    try:
      run = run_model.restore(step_dir)
    except (run_dir_lib.CheckpointError, config_lib.ConfigError) as e:
      return checks + [Check('LoRA base', False, str(e))]
    base = lora_checkpoint.recorded_base(run_dir).get('path', config.init_from)
    checks.append(Check('LoRA base', True, f'{base}, merged with the adapters for parity'))
    config, params = run.config, run.params
  if not parity:
    return checks
  if model_lib.ModelConfig.from_config(config).score_head:  # no logits to compare
    why = (
      'a reward model has a score, not logits; skipped (transformers *ForSequenceClassification '
      'parity of its export: tests/train/reward_stage_test.py)'
    )
    return checks + [Check('logits parity', True, why)]
  if hf_dir is not None:
    checks.append(check_hf_weights(hf_dir, params, config))
    family = families.detect(hf_config.read(hf_dir))
    if family.parity is not None and family.source_parity:
      return checks + check_parity(params, config, hf_dir, dtype=dtype, **parity_kwargs)
    # LLaDA, LLaDA-MoE (no PyTorch forward here reads their names), Qwen3-MoE (Family.parity):
    # the forward runs on an export of the weights the check above found equal to hf_dir's.
  with tempfile.TemporaryDirectory(prefix='dlmjax_verify_') as tmp:
    hf_io.write_hf(tmp, config, params, dtype=dtype, copy_tokenizer=False)
    family = families.detect(hf_config.read(tmp))
    if family.parity is None:  # an MoE export (LLaDA-MoE's, LLaDA2's names)
      why = f"no PyTorch forward here reads {family.name}'s names; skipped"
      return checks + [Check('logits parity', True, why)]
    return checks + check_parity(params, config, tmp, dtype=dtype, **parity_kwargs)


def report(checks: list[Check]) -> str:
  lines = [f'[{"PASS" if c.ok else "FAIL"}] {c.name}: {c.detail}' for c in checks]
  failed = sum(not c.ok for c in checks)
  lines.append(
    f'{len(checks) - failed}/{len(checks)} checks passed' + (f'; {failed} FAILED' if failed else '')
  )
  return '\n'.join(lines)


@extras.name_missing_extras('python -m dlmjax.verify')
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.verify',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--checkpoint-path', required=True, help='run directory or step directory')
  parser.add_argument(
    '--hf-dir',
    default=None,
    help='an export of it to check (default: export to a temporary directory)',
  )
  parser.add_argument('--dtype', choices=sorted(TOLERANCES), default='fp32')
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--seq-len', type=int, default=0, help='default: min(model.seq_len, 128)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--backend', choices=('auto', 'transformers', 'reference'), default='auto')
  parser.add_argument('--no-parity', action='store_true', help='integrity checks only')
  args = parser.parse_args(argv)
  try:
    checks = verify(
      args.checkpoint_path,
      hf_dir=args.hf_dir,
      dtype=args.dtype,
      parity=not args.no_parity,
      batch=args.batch,
      length=args.seq_len,
      seed=args.seed,
      backend=args.backend,
    )
  except (
    config_lib.ConfigError,
    hf_config.HFConfigError,
    hf_mapping.MappingError,
    safetensors_io.SafetensorsError,
  ) as e:
    checks = [Check('verification', False, str(e))]
  print(report(checks))
  return 0 if all(c.ok for c in checks) else 1


if __name__ == '__main__':
  sys.exit(main())
