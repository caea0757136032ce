"""python -m dlmjax.convert: orbax checkpoints <-> Hugging Face safetensors and PyTorch files.

    python -m dlmjax.convert to-hf --checkpoint-path runs/x [--dtype bf16|fp32] --output-dir hf/x
        [--layout source|qwen3|qwen2|llama|llada|...]
    python -m dlmjax.convert from-hf --hf-dir hf/x --output-dir runs/y [--config configs/z.py]
    python -m dlmjax.convert to-torch --checkpoint-path runs/x --output x.pt [--dtype fp32|bf16]
    python -m dlmjax.convert from-torch --input x.pt --output-dir runs/y [--config configs/z.py]

--layout picks the Hugging Face family whose names and config.json the export writes
(dlmjax/checkpoint/hf_layouts.py); the default, source, is the family the checkpoint was imported
from, else the one the model's options choose (Qwen3 with QK-norm, Qwen2 with q/k/v biases, Llama
with neither).

A LoRA run (train.lora.rank > 0; its checkpoints hold the adapters) exports to-hf and to-torch
as the merged model, W + (alpha / r) A B in every adapted weight; to-hf with `--adapter peft` as
a PEFT adapter directory instead (adapter_config.json + adapter_model.safetensors, PEFT's names
for the exported layout) beside the base it trained on, exported to OUTPUT_DIR/base (docs/lora.md):

    python -m dlmjax.convert to-hf --checkpoint-path runs/lora --output-dir hf/lora --adapter peft

The formats, and the library other modules call, are in dlmjax/checkpoint/hf_io.py. The command
line runs as one process.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from dlmjax import config as config_lib
from dlmjax import extras
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hf_layouts
from dlmjax.checkpoint import hf_mapping
from dlmjax.checkpoint import peft_io
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import run_model
from dlmjax.checkpoint import safetensors_io
from dlmjax.model import quantize, score_head


# ----------------------------------------------------------------------------------------------
# LoRA runs


def lora_to_hf(
  checkpoint_path: str,
  output_dir: str,
  *,
  adapter: str = 'merged',
  layout: str = hf_layouts.SOURCE,
  **kwargs,
) -> str:
  """A LoRA run's step as the merged Hugging Face model (in `layout`), or as a PEFT adapter
  directory with its base exported to output_dir/base in the layout its PEFT names address."""
  if adapter == 'merged':
    run = run_model.restore(checkpoint_path)
    return hf_io.write_hf(output_dir, run.config, run.params, layout=layout, **kwargs)
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(checkpoint_path)
  config = run_dir_lib.load_run_config(run_dir)
  cfg, adapters, frozen = run_model.restore_lora(run_dir, step_dir, config)
  plain = config.copy_and_resolve_references()
  plain.train.lora.rank = 0  # the exported base is a plain model
  family = hf_mapping.export_family(cfg)
  if layout not in (hf_layouts.SOURCE, family):
    raise hf_io.ConvertError(
      f'--adapter peft names the modules of the {family} layout; drop --layout {layout}, or '
      'export the merged model (--adapter merged) in that layout.'
    )
  base_dir = os.path.join(output_dir, 'base')
  base = quantize.dequantize_tree(frozen)
  if cfg.score_head:  # a reward model's base: the head the run started with (its seed's draw)
    base = score_head.attach(base, cfg, config.seed)
  hf_io.write_hf(base_dir, plain, base, layout=family, **kwargs)
  return peft_io.write_adapter(
    output_dir,
    adapters,
    cfg,
    base_model=os.path.abspath(base_dir),
    dropout=config.train.lora.dropout,
  )


# ----------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.convert',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest='command', required=True)
  to_hf = sub.add_parser('to-hf', help='orbax checkpoint -> Hugging Face directory')
  to_hf.add_argument('--checkpoint-path', required=True, help='run directory or step directory')
  to_hf.add_argument('--output-dir', required=True)
  to_hf.add_argument('--dtype', choices=sorted(hf_io.DTYPES), default='bf16')
  to_hf.add_argument('--max-shard-size', default='5GB')
  to_hf.add_argument(
    '--layout',
    choices=hf_layouts.choices(),
    default=hf_layouts.SOURCE,
    help='the family whose names and config.json to write; source (default): the family the '
    "checkpoint came from, else the one the model's options choose",
  )
  to_hf.add_argument(
    '--adapter',
    choices=('merged', 'peft'),
    default='merged',
    help='a LoRA run: the merged model (default), or a PEFT adapter plus its base in OUTPUT/base',
  )
  to_torch = sub.add_parser('to-torch', help='orbax checkpoint -> PyTorch .pt')
  to_torch.add_argument('--checkpoint-path', required=True)
  to_torch.add_argument('--output', required=True)
  to_torch.add_argument('--dtype', choices=sorted(hf_io.DTYPES), default='fp32')
  for p in (to_hf, to_torch):
    p.add_argument(
      '--trim-vocab',
      action='store_true',
      help="write only the tokenizer's rows, not the padded embedding",
    )
  from_hf = sub.add_parser('from-hf', help='Hugging Face directory -> orbax run directory')
  from_hf.add_argument(
    '--hf-dir', required=True, help='Hugging Face directory or hub id org/name[@revision]'
  )
  from_torch = sub.add_parser('from-torch', help='PyTorch .pt -> orbax run directory')
  from_torch.add_argument('--input', required=True)
  for p in (from_hf, from_torch):
    p.add_argument('--output-dir', required=True)
    p.add_argument('--config', default=None, help='configs/x.py[:arg]; default: from the input')
    p.add_argument(
      '--missing-qk-norm',
      choices=hf_mapping.MISSING_QK_NORM,
      default='error',
      help='a model without QK-norm (Llama, Qwen2, LLaDA) imports exactly with '
      'model.qk_norm=False; into a QK-norm model (--config with model.qk_norm=True, or "ones" '
      'without --config) it is refused, or takes unit scales with "ones" (a different function; '
      'a start for further training only)',
    )
  return parser


@extras.name_missing_extras('python -m dlmjax.convert')
def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    if getattr(args, 'output_dir', None):  # before any reading: a file there is refused at once
      hf_io.check_output_dir(args.output_dir)
    if args.command in ('to-torch', 'from-torch'):  # a missing torch is named before any reading
      import torch  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    if args.command == 'to-hf' and run_model.is_lora_run(args.checkpoint_path):
      out = lora_to_hf(
        args.checkpoint_path,
        args.output_dir,
        adapter=args.adapter,
        layout=args.layout,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        trim_vocab=args.trim_vocab,
      )
    elif args.command == 'to-hf':
      if args.adapter != 'merged':
        raise config_lib.ConfigError(
          f'--adapter {args.adapter}: {args.checkpoint_path} is no LoRA run (train.lora.rank is '
          '0); drop --adapter.'
        )
      out = hf_io.hf_from_checkpoint(
        args.checkpoint_path,
        args.output_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        trim_vocab=args.trim_vocab,
        layout=args.layout,
      )
    elif args.command == 'to-torch' and run_model.is_lora_run(args.checkpoint_path):
      run = run_model.restore(args.checkpoint_path)  # merged
      out = hf_io.write_torch(
        args.output, run.config, run.params, dtype=args.dtype, trim_vocab=args.trim_vocab
      )
    elif args.command == 'to-torch':
      out = hf_io.torch_from_checkpoint(
        args.checkpoint_path, args.output, dtype=args.dtype, trim_vocab=args.trim_vocab
      )
    else:
      config = config_lib.load_file(args.config) if args.config else None
      if args.command == 'from-hf':
        out = hf_io.checkpoint_from_hf(
          args.hf_dir, args.output_dir, config=config, missing_qk_norm=args.missing_qk_norm
        )
      else:
        out = hf_io.checkpoint_from_torch(
          args.input, args.output_dir, config=config, missing_qk_norm=args.missing_qk_norm
        )
  except (
    hf_io.ConvertError,
    run_dir_lib.CheckpointError,
    hf_config.HFConfigError,
    hf_mapping.MappingError,
    safetensors_io.SafetensorsError,
    config_lib.ConfigError,
  ) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    print(f'wrote {out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
