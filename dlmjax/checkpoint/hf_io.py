"""Hugging Face safetensors and PyTorch files <-> our params: the library `dlmjax.convert` runs.

The HF directory is in one of hf_layouts' layouts (default: the family the checkpoint came from,
else the transformers family of its options: Qwen3ForCausalLM, Qwen2ForCausalLM or
LlamaForCausalLM loads it), with MegaDLMs DiffLM's `mask_token_id` and `attn_mask_type`, our
modeling_dlmjax.py (auto_map) for the mask kind, our full config in dlmjax_config.json and the
tokenizer files.
The .pt file holds {'state_dict' (the same names), 'hf_config', 'dlmjax_config'}. An import records
the source family (and directory) in its checkpoint's metadata (`source`, step_meta.read_meta).
Tensors move one at a time (hf_mapping): exports hold one tensor on the host beside the restored
params, imports build one stacked array at a time and move it to the device. Orbax's own restore
and save buffers dominate host memory (1.7B on an H200: to-hf 29 s, 11.7 GiB peak RSS; from-hf
38 s, 22.6 GiB, as much as orbax needs to save those params from the GPU).
`write_hf` may be called from a multi-process job: every process gathers, process 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.observability import progress
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_dir as hf_dir_lib
from dlmjax.checkpoint import hf_layouts
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import safetensors_io
from dlmjax.checkpoint import step_meta
from dlmjax.data import errors as data_errors
from dlmjax.data import run_tokenizer
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.model import lora
from dlmjax.parallel import distributed

DTYPES = {'fp32': np.dtype(np.float32), 'bf16': np.dtype(ml_dtypes.bfloat16)}
TORCH_FORMAT = 'dlmjax-torch-v1'
# Files of a Hugging Face tokenizer; whichever exist are copied with an export.
TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'tokenizer.model',
  'vocab.json',
  'merges.txt',
  'added_tokens.json',
  'generation_config.json',
)
# A Hugging Face directory's config is read without jax (checkpoint/hf_dir.py); named here too.
is_hf_dir = hf_dir_lib.is_hf_dir
hf_dir_config = hf_dir_lib.hf_dir_config


class ConvertError(RuntimeError):
  """A conversion that cannot proceed; the message says why and what to do."""


def _vocab_rows(config, trim_vocab: bool) -> int:
  return config.model.vocab_size if trim_vocab else config_lib.padded_vocab_size(config)


def check_tokenizer_vocab(tokenizer: str | None, vocab_size: int, what: str) -> None:
  """Refuses a tokenizer with more ids than the model has embedding rows (`what` names them).

  Its ids past vocab_size would index rows that do not exist: the tokenizer is not the one the
  model was trained with. A smaller tokenizer is normal (Qwen pads its embedding past it).
  """
  if tokenizer is None:
    return
  try:
    size = tokenizer_lib.vocab_size(tokenizer)
  except ImportError as e:
    print(f'note: tokenizer {tokenizer} not checked against the vocabulary ({e}).')
    return
  except (data_errors.DataError, OSError, RuntimeError, ValueError) as e:
    raise ConvertError(f'cannot read the tokenizer {tokenizer} ({e}); fix or remove it.') from e
  if size > vocab_size:
    raise ConvertError(
      f'vocab mismatch: the tokenizer {tokenizer} has {size} tokens but {what} is {vocab_size}, '
      f'so ids {vocab_size}..{size - 1} have no embedding row. Use the tokenizer the model was '
      f'trained with (data.tokenizer, or the tokenizer files beside the weights), or give the '
      f'model {size} rows (model.vocab_size) and train it.'
    )


# ----------------------------------------------------------------------------------------------
# Export


def check_output_dir(path: str, flag: str = '--output-dir') -> None:
  """Refuses an output directory that is an existing file, before any work."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConvertError(f'{flag} {path} is an existing file, not a directory; choose another path.')


def write_hf(
  output_dir: str,
  config,
  params: dict,
  *,
  dtype: str = 'bf16',
  max_shard_size: str | int = '5GB',
  trim_vocab: bool = False,
  copy_tokenizer: bool = True,
  layout: str = hf_layouts.SOURCE,
  source_family: str | None = None,
) -> str:
  """Writes params (ours, any placement) as a Hugging Face directory in `layout` (hf_layouts:
  `source` is source_family's layout, else the family of the model's options); returns it."""
  if dtype not in DTYPES:
    raise ConvertError(f'--dtype={dtype!r} is not one of {sorted(DTYPES)}.')
  check_output_dir(output_dir)
  cfg = model_lib.ModelConfig.from_config(config)
  chosen = hf_layouts.choose(layout, cfg, source_family=source_family)
  tokenizer = run_tokenizer.find(config) if copy_tokenizer else None
  check_tokenizer_vocab(tokenizer, config.model.vocab_size, "the run's model.vocab_size")
  rows = _vocab_rows(config, trim_vocab)
  np_dtype = DTYPES[dtype]
  entries = [
    (n, s, np_dtype) for n, s in hf_mapping.export_entries(cfg, vocab_rows=rows, names=chosen.names)
  ]
  tensors = _cast_each(
    hf_mapping.export_tensors(
      params, cfg, vocab_rows=rows, to_host=distributed.to_host, names=chosen.names
    ),
    np_dtype,
  )
  if jax.process_index() != 0:
    for _ in tensors:  # take part in any cross-process gathers; write nothing.
      pass
    return output_dir
  tensors = progress.track(tensors, 'export', total=len(entries))
  safetensors_io.write_model(
    output_dir,
    entries,
    tensors,
    max_shard_bytes=safetensors_io.parse_size(max_shard_size),
    metadata={'format': 'pt'},
  )
  hf = chosen.config_json(config, vocab_rows=rows, dtype=dtype)
  if cfg.score_head:  # a reward model (hf_layouts.choose refused a layout without the class)
    hf = hf_layouts.sequence_classification_json(chosen, hf, config)
  with open(os.path.join(output_dir, 'config.json'), 'w') as f:
    json.dump(hf, f, indent=2)
  with open(os.path.join(output_dir, hf_config.DLMJAX_CONFIG_FILE), 'w') as f:
    f.write(config.to_json(indent=2, sort_keys=True))
  if chosen.ships_modeling and not cfg.score_head:
    shutil.copy(_MODELING_PATH, os.path.join(output_dir, hf_config.MODELING_FILE))
  if copy_tokenizer:
    _copy_tokenizer(tokenizer, output_dir)
    if tokenizer is not None:
      _write_tokenizer_config(tokenizer, output_dir, config)
  return output_dir


# The transformers classes exports ship (config.json's auto_map names them), package data.
_MODELING_PATH = os.path.join(os.path.dirname(__file__), 'hf_modeling', hf_config.MODELING_FILE)


def _cast_each(tensors, dtype):
  """(name, array) -> (name, array as dtype), dropping the source before the cast one is yielded
  (no copy at all when it already has the dtype), so at most one tensor is held at a time."""
  for name, array in tensors:
    array = array.astype(dtype, copy=False)
    yield name, array
    del array  # not kept alive while the next tensor is gathered.


def _copy_tokenizer(tokenizer: str, output_dir: str) -> None:
  """Copies the run's tokenizer: a Hugging Face tokenizer directory, or a SentencePiece model."""
  if tokenizer is None:
    print(
      'note: no tokenizer copied (data.tokenizer is not a local path, and the run does not '
      'use a built-in corpus built here).'
    )
    return
  if os.path.isdir(tokenizer):
    for name in TOKENIZER_FILES:
      if os.path.exists(os.path.join(tokenizer, name)):
        shutil.copy(os.path.join(tokenizer, name), os.path.join(output_dir, name))
  elif tokenizer.endswith('.model'):
    shutil.copy(tokenizer, os.path.join(output_dir, 'tokenizer.model'))
  else:
    shutil.copy(tokenizer, os.path.join(output_dir, os.path.basename(tokenizer)))


# transformers' class for a tokenizer.json (or, converted on load, a SentencePiece model) taken as
# it is: the name in v4 and v5 (an alias of TokenizersBackend there). Without it AutoTokenizer
# picks the model_type's class (Qwen2Tokenizer for a qwen3 export), whose own pre-tokenizer
# splits a SentencePiece vocabulary differently (it dropped the spaces).
_TOKENIZER_CLASS = 'PreTrainedTokenizerFast'


def _write_tokenizer_config(tokenizer: str, output_dir: str, config) -> None:
  """tokenizer_config.json for AutoTokenizer: the tokenizer taken exactly as dlmjax reads it, and
  the model's end-of-document, padding and mask pieces as eos/pad/mask tokens. A copied
  tokenizer_config.json keeps its fields (chat template, its own class); the special tokens are
  set to the model's."""
  path = os.path.join(output_dir, 'tokenizer_config.json')
  fields = {}
  if os.path.exists(path):
    with open(path) as f:
      fields = json.load(f)
  fields.setdefault('tokenizer_class', _TOKENIZER_CLASS)
  fields.setdefault('add_bos_token', False)  # dlmjax encodes without BOS/EOS (data/tokenizer.py).
  fields.setdefault('add_eos_token', False)
  fields.setdefault('clean_up_tokenization_spaces', False)  # decode(encode(text)) == text
  # Only its pieces are read: the ids are the model's, so none is looked up by piece here.
  loaded = tokenizer_lib.load_tokenizer(tokenizer, eod_token=0, pad_token=0, require_mask=False)
  m = config.model
  for field, token_id in (
    ('eos_token', m.eos_token_id),
    ('pad_token', m.pad_token_id),
    ('mask_token', m.mask_token_id),
  ):
    piece = loaded.id_piece(token_id)
    if piece is not None:  # a mask row past the tokenizer's ids has no piece to name.
      fields[field] = piece
  fields.setdefault('model_max_length', m.seq_len)
  with open(path, 'w') as f:
    json.dump(fields, f, indent=2, ensure_ascii=False)


def _restore(checkpoint_path: str):
  """A full run's params (a LoRA run's go through checkpoint/run_model.py, as convert does)."""
  run_dir, step_dir, step = run_dir_lib.resolve_step_dir(checkpoint_path)
  config = run_dir_lib.load_run_config(run_dir)
  if lora.is_lora_run(config):
    raise ConvertError(
      f'{checkpoint_path} is a LoRA run (adapters over a base): export it with python -m '
      'dlmjax.convert, which merges them, or read it with checkpoint/run_model.py.'
    )
  shapes, shardings = model_lib.param_placement(config)
  return config, params_checkpoint.restore_params(step_dir, shapes, shardings), step


def source_family(checkpoint_path: str) -> str | None:
  """The Hugging Face family a checkpoint came from: its import's `source` metadata, else that
  of what its run started from (init_from: a Hugging Face directory, or an imported run)."""
  seen = set()
  while checkpoint_path and checkpoint_path not in seen:
    seen.add(checkpoint_path)
    if is_hf_dir(checkpoint_path):
      try:
        return hf_config.detect_architecture(hf_config.read(checkpoint_path))
      except hf_config.HFConfigError:
        return None
    try:
      run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(checkpoint_path)
      family = (step_meta.read_meta(step_dir).get('source') or {}).get('family')
      checkpoint_path = run_dir_lib.load_run_config(run_dir).get('init_from') or ''
    except (run_dir_lib.CheckpointError, OSError, ValueError):
      return None
    if family:
      return family
  return None


def hf_from_checkpoint(
  checkpoint_path: str, output_dir: str, *, layout: str = hf_layouts.SOURCE, **kwargs
) -> str:
  """Exports a run directory (latest step) or step directory to a Hugging Face directory in
  `layout` (default: the family the checkpoint came from, hf_layouts)."""
  check_output_dir(output_dir)
  config, params, _ = _restore(checkpoint_path)
  family = source_family(checkpoint_path) if layout == hf_layouts.SOURCE else None
  return write_hf(output_dir, config, params, layout=layout, source_family=family, **kwargs)


def torch_from_checkpoint(
  checkpoint_path: str, output_file: str, *, dtype: str = 'fp32', trim_vocab: bool = False
) -> str:
  """A run directory (latest step) or step directory as a PyTorch file (write_torch)."""
  config, params, _ = _restore(checkpoint_path)
  return write_torch(output_file, config, params, dtype=dtype, trim_vocab=trim_vocab)


def write_torch(
  output_file: str, config, params: dict, *, dtype: str = 'fp32', trim_vocab: bool = False
) -> str:
  """Writes {'state_dict', 'hf_config', 'dlmjax_config', 'format'} with torch.save.

  torch.save needs the whole dict in host memory, so the model is on the host once as torch
  tensors (beside the params, which stay on their device).
  """
  import torch  # pylint: disable=import-outside-toplevel

  cfg = model_lib.ModelConfig.from_config(config)
  rows = _vocab_rows(config, trim_vocab)
  torch_dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16}[dtype]
  tensors = hf_mapping.export_tensors(params, cfg, vocab_rows=rows, to_host=distributed.to_host)
  state_dict = {
    name: torch.from_numpy(np.require(array, requirements='W')).to(torch_dtype)
    for name, array in tensors
  }
  if jax.process_index() == 0:
    payload = dict(
      format=TORCH_FORMAT,
      state_dict=state_dict,
      hf_config=hf_config.to_hf(config, vocab_rows=rows, dtype=dtype),
      dlmjax_config=config.to_json(sort_keys=True),
    )
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    torch.save(payload, output_file + '.partial')
    os.replace(output_file + '.partial', output_file)
  return output_file


# ----------------------------------------------------------------------------------------------
# Import


def params_from_source(source, hf: dict, config, *, missing_qk_norm: str = 'error') -> dict:
  """Our params, each array moved to the default device as soon as it is built."""
  arch = hf_config.detect_architecture(hf)
  device = jax.local_devices()[0]
  return hf_mapping.import_params(
    source,
    arch,
    model_lib.ModelConfig.from_config(config),
    vocab_size=config.model.vocab_size,
    missing_qk_norm=missing_qk_norm,
    place=lambda array: jax.device_put(array, device),
  )


def load_hf(hf_dir: str, *, config=None, missing_qk_norm: str = 'error'):
  """(config, params on the first local device) of a Hugging Face directory we can read."""
  hf, config = hf_dir_config(hf_dir, config, missing_qk_norm=missing_qk_norm)
  config_lib.validate(config)
  arch = hf_config.detect_architecture(hf)
  shipped = hf_dir_lib.shipped_tokenizer(hf_dir)
  check_tokenizer_vocab(
    shipped,
    hf_config.embedding_rows(hf, arch),
    f"the embedding's rows (vocab_size in {hf_dir}/config.json)",
  )
  tokenizer = run_tokenizer.find(config)
  if tokenizer is not None and (
    shipped is None or os.path.abspath(tokenizer) != os.path.abspath(shipped)
  ):
    check_tokenizer_vocab(tokenizer, config.model.vocab_size, 'model.vocab_size')
  source = safetensors_io.SafetensorsReader(hf_dir)
  return config, params_from_source(source, hf, config, missing_qk_norm=missing_qk_norm)


def _save(output_dir: str, config, params: dict, source: dict) -> str:
  if os.path.exists(os.path.join(output_dir, run_dir_lib.CHECKPOINT_DIR)):
    raise ConvertError(f'{output_dir} already holds checkpoints; choose a new --output-dir.')
  return params_checkpoint.save_params_checkpoint(output_dir, config, params, source=source)


def _source(hf: dict, path: str) -> dict:
  """What an import records of its source: the Hugging Face family and where it came from."""
  return dict(family=hf_config.detect_architecture(hf), path=os.path.abspath(path))


def checkpoint_from_hf(
  hf_dir: str, output_dir: str, *, config=None, missing_qk_norm: str = 'error'
) -> str:
  """Imports a Hugging Face directory (or hub id) as a params-only run directory; returns the
  step dir."""
  check_output_dir(output_dir)
  hf_dir = hub.resolve(hf_dir)
  config, params = load_hf(hf_dir, config=config, missing_qk_norm=missing_qk_norm)
  config.output_dir = os.path.abspath(output_dir)
  return _save(output_dir, config, params, _source(hf_config.read(hf_dir), hf_dir))


def checkpoint_from_torch(
  input_file: str, output_dir: str, *, config=None, missing_qk_norm: str = 'error'
) -> str:
  """Imports a .pt written by to-torch (or a plain Qwen3-named state dict, with --config)."""
  import torch  # pylint: disable=import-outside-toplevel

  check_output_dir(output_dir)
  payload = torch.load(input_file, map_location='cpu', weights_only=True, mmap=True)
  if isinstance(payload, dict) and payload.get('format') == TORCH_FORMAT:
    state_dict, hf, saved_json = (
      payload['state_dict'],
      payload['hf_config'],
      payload['dlmjax_config'],
    )
  elif isinstance(payload, dict) and all(isinstance(v, torch.Tensor) for v in payload.values()):
    if config is None:
      raise ConvertError(f'{input_file} is a bare state dict; pass --config to say which model.')
    state_dict, hf, saved_json = (
      payload,
      hf_config.to_hf(
        config, vocab_rows=payload['model.embed_tokens.weight'].shape[0], dtype='fp32'
      ),
      None,
    )
  else:
    raise ConvertError(
      f'{input_file} is neither a dlmjax .pt ({TORCH_FORMAT}) nor a state dict of tensors.'
    )
  config = hf_dir_lib.resolve_config(hf, config, saved_json, missing_qk_norm)
  check_tokenizer_vocab(run_tokenizer.find(config), config.model.vocab_size, 'model.vocab_size')
  config.output_dir = os.path.abspath(output_dir)
  source = hf_mapping.DictSource(state_dict, to_numpy=lambda t: t.float().numpy())
  params = params_from_source(source, hf, config, missing_qk_norm=missing_qk_norm)
  return _save(output_dir, config, params, _source(hf, input_file))
