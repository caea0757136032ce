"""python -m dlmjax.distill: the frozen teacher's rows for distillation (sft.objective).

  python -m dlmjax.distill --init-from runs/demo/seed0/sft --task arithmetic --num 512 \
      --output runs/demo/seed0/teacher.npz [--keep all|correct] [--retries N] [--override K=V]

The teacher (the checkpoint the student starts from) decodes prompts with dlmjax's own sampler,
greedy, its run's sampler settings unless overridden, recording the step that committed each
token (the `steps` decode record). The rows (data/teacher_rows.py) are the student's targets:
dParallel's and d3LLM's self-distillation train on the teacher's own answers (dParallel arXiv
2509.26488; d3LLM arXiv 2601.07568), d3LLM masking the tokens the teacher committed late. Prompts
are the task's TRAIN split (the held-out split never enters), or the "prompt" of each row of
--prompts FILE.jsonl; they get the teacher's chat template, and ones too long for the canvas
(model.seq_len - gen_length) are skipped. Generated once, ahead of training: cheaper than
decoding inside every step, and the rows are fixed for every seed and objective.

Which rows to keep (--keep): `all` (d3LLM trains on every row, its is_correct filter commented
out) or `correct`, the rows whose completion the task judges correct (dParallel keeps the
teacher's correct answers): distilling a weak teacher's wrong answers teaches them with
certainty. --retries N decodes a wrong answer again at d3LLM's rising temperatures (0.1 .. 0.4)
and keeps the last try.
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
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config

KEEP = ('all', 'correct')
# d3LLM's regeneration: up to 5 tries, at temperature 0.0 then these, until the answer matches.
RETRY_TEMPERATURES = (0.1, 0.2, 0.3, 0.4)


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
  parser.add_argument('--keep', choices=KEEP, default='all', help='rows kept (default all)')
  parser.add_argument(
    '--retries',
    type=int,
    default=0,
    choices=range(len(RETRY_TEMPERATURES) + 1),
    help='decode a wrong answer again at temperature 0.1, 0.2, ... (d3LLM: 4)',
  )
  return parser


def prompts_of(args) -> tuple[list[str], list | None]:
  """(prompts, the task's examples behind them, None for --prompts rows: no answer to judge)."""
  if args.prompts:
    if args.keep != 'all' or args.retries:
      raise ValueError(
        '--prompts rows carry no answer to judge, so --keep correct and --retries need a '
        '--task instead; drop --prompts or use --keep all --retries 0.'
      )
    with open(args.prompts) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return [r['prompt'] for r in rows][: args.num], None
  if args.task not in tasks_lib.TASKS:
    raise ValueError(f'--task {args.task!r}: choose one of {sorted(tasks_lib.TASKS)}.')
  examples = tasks_lib.get_task(args.task).examples('train', args.num, args.seed)
  return [e.prompt for e in examples], examples


def teacher_sampling(config, overrides):
  """The run's sampler group, greedy, with KEY=VALUE overrides on top."""
  base = sampling_config.SamplingConfig.from_config(config)
  values = dict(o.split('=', 1) for o in overrides)
  return dataclasses.replace(
    sampling_config.SamplingConfig.from_values(**{**dataclasses.asdict(base), **values}),
    temperature=0.0,
  ).validate()


def build_rows(pretrained, prompt_ids, sampling, *, batch_size: int, seed: int) -> dict:
  """Decodes every prompt; rows in the SFT layout [N, seq_len + 1] with the commit steps."""
  m = pretrained.config.model
  width, gen = m.seq_len + 1, sampling.gen_length
  prompt_width = max(len(p) for p in prompt_ids)
  fn = sampler_programs.make_generate_fn(
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
    prompt_BP, lengths = prompt_rows.pad_prompts(padded, m.pad_token_id, prompt_width)
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


def encode_prompts(pretrained, prompts, gen_length: int) -> tuple[list[list[int]], list[int]]:
  """(token ids, their indices in `prompts`): the prompts in the teacher's chat template, those
  too long for the canvas (model.seq_len - gen_length) left out."""
  room = pretrained.config.model.seq_len - gen_length
  template = chat.checkpoint_template(pretrained.config)
  encoded = pretrained.tokenizer.encode_batch([chat.prompt_text(template, p) for p in prompts])
  kept = [i for i, p in enumerate(encoded) if 0 < len(p) <= room]
  return [list(encoded[i]) for i in kept], kept


def judge(rows, examples, task, decode, eos_id: int) -> np.ndarray:
  """bool [rows]: whether the task judges each row's completion (its RESPONSE tokens up to the
  first EOS, as text) correct, as held-out accuracy does."""
  texts = [
    decode(prompt_rows.completions(tokens[None, roles == RESPONSE], 0, eos_id)[0])
    for tokens, roles in zip(rows['tokens'], rows['roles'])
  ]
  return np.array(task.judge(examples, texts)[1], bool)


def decode_judged(decode_fn, judge_fn, num: int, *, retries: int) -> tuple[dict, np.ndarray]:
  """(rows, correct [num]) of `num` problems: decode_fn(indices, attempt) -> rows decodes them
  (attempt 0 greedy, attempt k at RETRY_TEMPERATURES[k - 1]), judge_fn(rows, indices) -> bool
  judges them; the wrong ones are decoded again up to `retries` times, the last try kept."""
  everyone = np.arange(num)
  rows = decode_fn(everyone, 0)
  correct = judge_fn(rows, everyone)
  for attempt in range(1, retries + 1):
    wrong = np.flatnonzero(~correct)
    if not len(wrong):
      break
    retry = decode_fn(wrong, attempt)
    for key in rows:
      rows[key][wrong] = retry[key]
    correct[wrong] = judge_fn(retry, wrong)
  return rows, correct


def teacher_rows_of(pretrained, prompt_ids, examples, sampling, args) -> tuple[dict, np.ndarray]:
  """(rows, correct or None without a task) of every prompt, --retries applied."""
  m = pretrained.config.model

  def decode_fn(indices, attempt):
    retry = sampling
    if attempt:
      retry = dataclasses.replace(sampling, temperature=RETRY_TEMPERATURES[attempt - 1])
    ids = [prompt_ids[i] for i in indices]
    seed = args.seed + attempt
    return build_rows(pretrained, ids, retry.validate(), batch_size=args.batch_size, seed=seed)

  if examples is None:
    return decode_fn(range(len(prompt_ids)), 0), None
  task = tasks_lib.get_task(args.task)

  def judge_fn(rows, indices):
    judged = [examples[i] for i in indices]
    return judge(rows, judged, task, pretrained.tokenizer.decode, m.eos_token_id)

  return decode_judged(decode_fn, judge_fn, len(prompt_ids), retries=args.retries)


def kept_rows(rows, correct, keep: str, task: str) -> dict:
  """The rows --keep keeps; none left is an error naming the fixes."""
  if keep == 'all':
    return rows
  if not correct.any():
    raise ValueError(
      f'--keep correct: the teacher answered none of its {len(correct)} {task} problems '
      'correctly, so no row is left; decode more (--num), distil a better teacher, or use '
      '--keep all.'
    )
  return {k: v[correct] for k, v in rows.items()}


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    pretrained = inference.load_pretrained(args.init_from)
    config = pretrained.config
    sampling = teacher_sampling(config, args.override)
    prompts, examples = prompts_of(args)
    prompt_ids, fitting = encode_prompts(pretrained, prompts, sampling.gen_length)
    examples = None if examples is None else [examples[i] for i in fitting]
    if not prompt_ids:
      raise ValueError(
        f'no prompt fits the canvas: model.seq_len {config.model.seq_len} - gen_length '
        f'{sampling.gen_length} = {config.model.seq_len - sampling.gen_length} tokens; lower '
        '--override gen_length=N.'
      )
    decoded, correct = teacher_rows_of(pretrained, prompt_ids, examples, sampling, args)
    rows = kept_rows(decoded, correct, args.keep, args.task)
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  teacher_rows.write(args.output, rows)
  done = rows['commit_steps'] >= 0
  steps = [len(np.unique(s[d])) for s, d in zip(rows['commit_steps'], done)]
  judged = '' if correct is None else f', {int(correct.sum())} judged correct'
  judged += f' after --retries {args.retries}' if args.retries else ''
  print(
    f'kept {len(steps)} of {len(prompt_ids)} decoded teacher rows (--keep {args.keep}{judged}; '
    f'{len(prompts) - len(prompt_ids)} prompts too long) -> {args.output}: '
    f'{sampling.gen_length} tokens in {np.mean(steps):.1f} steps on average '
    f'(cache {sampling.cache}, threshold {sampling.threshold:g})'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
