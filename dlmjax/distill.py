"""python -m dlmjax.distill: the frozen teacher's rows for distillation (sft.objective).

  python -m dlmjax.distill --init-from runs/demo/seed0/sft --task arithmetic --num 512 \
      --output runs/demo/seed0/teacher.npz [--steps N] [--threshold T] [--cache dual]

The teacher (the checkpoint the student starts from) decodes prompts with dlmjax's own sampler,
greedy, its run's sampler settings unless overridden, recording the step that committed each
token (the `steps` decode record). The rows (data/teacher_rows.py) are the student's targets:
dParallel's and d3LLM's self-distillation train on the teacher's own answers (dParallel arXiv
2509.26488; d3LLM arXiv 2601.07568), d3LLM masking the tokens the teacher committed late. Prompts
are the task's TRAIN split (the held-out split never enters), or the "prompt" of each row of
--prompts FILE.jsonl; they get the teacher's chat template, and ones too long for the canvas
(model.seq_len - gen_length) are skipped. Generated once, ahead of training: cheaper than
decoding inside every step, and the rows are fixed for every seed and objective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import numpy as np

from dlmjax import cli, inference
from dlmjax import tasks as tasks_lib
from dlmjax.data import chat, teacher_rows
from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from dlmjax.diffusion import sampler as sampler_lib


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.distill',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--init-from', required=True, help='the teacher: a run or step directory')
  parser.add_argument('--output', required=True, help='the .npz to write (sft.teacher_file)')
  parser.add_argument('--task', default='arithmetic', help='its train split gives the prompts')
  parser.add_argument('--prompts', default='', help='jsonl rows with a "prompt" instead')
  parser.add_argument('--num', type=int, default=512, help='prompts (task train problems)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--batch-size', type=int, default=32)
  parser.add_argument('--override', action='append', default=[], help='sampler KEY=VALUE')
  return parser


def prompts_of(args) -> list[str]:
  if args.prompts:
    with open(args.prompts) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return [r['prompt'] for r in rows][: args.num]
  if args.task not in tasks_lib.TASKS:
    raise ValueError(f'--task {args.task!r}: choose one of {sorted(tasks_lib.TASKS)}.')
  return [e.prompt for e in tasks_lib.get_task(args.task).examples('train', args.num, args.seed)]


def teacher_sampling(config, overrides):
  """The run's sampler group, greedy, with KEY=VALUE overrides on top."""
  base = sampler_lib.SamplingConfig.from_config(config)
  values = dict(o.split('=', 1) for o in overrides)
  return dataclasses.replace(
    sampler_lib.SamplingConfig.from_values(**{**dataclasses.asdict(base), **values}),
    temperature=0.0,
  ).validate()


def build_rows(pretrained, prompt_ids, sampling, *, batch_size: int, seed: int) -> dict:
  """Decodes every prompt; rows in the SFT layout [N, seq_len + 1] with the commit steps."""
  m = pretrained.config.model
  width, gen = m.seq_len + 1, sampling.gen_length
  prompt_width = max(len(p) for p in prompt_ids)
  fn = sampler_lib.make_generate_fn(
    pretrained.model_config,
    sampling,
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
    with_steps=True,
  )
  rows = {k: np.zeros((len(prompt_ids), width), np.int32) for k in teacher_rows.KEYS}
  rows['tokens'][:] = m.eos_token_id
  rows['roles'][:] = PADDING
  rows['commit_steps'][:] = -1
  key = jax.random.key(seed)
  for first in range(0, len(prompt_ids), batch_size):
    chunk = prompt_ids[first : first + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one compiled batch shape
    prompt_BP, lengths = sampler_lib.pad_prompts(padded, m.pad_token_id, prompt_width)
    tokens, steps = fn(pretrained.params, prompt_BP, lengths, jax.random.fold_in(key, first))
    tokens, steps = np.asarray(tokens)[:, prompt_width:], np.asarray(steps)
    for i, prompt in enumerate(chunk):
      row, n = first + i, len(prompt)
      completion = tokens[i]
      eos = np.flatnonzero(completion == m.eos_token_id)
      answer = (eos[0] + 1) if len(eos) else gen
      rows['tokens'][row, :n] = prompt
      rows['tokens'][row, n : n + gen] = completion
      rows['roles'][row, :n] = PROMPT
      rows['roles'][row, n : n + answer] = RESPONSE
      rows['commit_steps'][row, n : n + gen] = steps[i]
  return rows


def encode_prompts(pretrained, prompts, gen_length: int) -> list[list[int]]:
  """The prompts in the teacher's chat template, as token ids; those too long for the canvas
  (model.seq_len - gen_length) are left out."""
  room = pretrained.config.model.seq_len - gen_length
  template = chat.checkpoint_template(pretrained.config)
  encoded = pretrained.tokenizer.encode_batch([chat.prompt_text(template, p) for p in prompts])
  return [list(p) for p in encoded if 0 < len(p) <= room]


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    pretrained = inference.load_pretrained(args.init_from)
    config = pretrained.config
    sampling = teacher_sampling(config, args.override)
    prompts = prompts_of(args)
    prompt_ids = encode_prompts(pretrained, prompts, sampling.gen_length)
    if not prompt_ids:
      raise ValueError(
        f'no prompt fits the canvas: model.seq_len {config.model.seq_len} - gen_length '
        f'{sampling.gen_length} = {config.model.seq_len - sampling.gen_length} tokens; lower '
        '--override gen_length=N.'
      )
    rows = build_rows(pretrained, prompt_ids, sampling, batch_size=args.batch_size, seed=args.seed)
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  teacher_rows.write(args.output, rows)
  done = rows['commit_steps'] >= 0
  steps = [len(np.unique(s[d])) for s, d in zip(rows['commit_steps'], done)]
  print(
    f'{len(prompt_ids)} teacher rows ({len(prompts) - len(prompt_ids)} prompts too long) -> '
    f'{args.output}: {sampling.gen_length} tokens in {np.mean(steps):.1f} steps on average '
    f'(cache {sampling.cache}, threshold {sampling.threshold:g})'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
