"""python -m dlmjax.evaluate: likelihood of (context, continuation) rows, and task accuracy.

  python -m dlmjax.evaluate --checkpoint-path P likelihood --data rows.jsonl [--mc-num 128]
  python -m dlmjax.evaluate --checkpoint-path P tasks --tasks countdown3,sudoku4 [--num 100]
  python -m dlmjax.evaluate --checkpoint-path P tasks --num 0 \\
      --tasks gsm8k=gsm8k_test.jsonl,math500=math500.jsonl,humaneval=humaneval.jsonl
  python -m dlmjax.evaluate --checkpoint-path P tasks --num 0 \\
      --tasks humaneval_infill=HumanEval-SingleLineInfilling.jsonl

likelihood rows are {"context", "continuation"} (log-likelihood per row and in sum) or
multiple-choice {"context", "choices": [...], "label": i} (accuracy of the most likely choice,
and acc_norm: per character, as lm-eval). Scores are LLaDA's Monte Carlo ELBO
(dlmjax/diffusion/likelihood.py); tasks decode with the sampler and score with dlmjax.tasks:
accuracy, mean reward and the peers' metrics (d1's eval, lm-eval's; docs/evaluation.md).
P is a run directory (latest step), a step directory or a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import numpy as np

from dlmjax import cli
from dlmjax import inference
from dlmjax import tasks as tasks_lib
from dlmjax.data import chat
from dlmjax.data import jsonl
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.diffusion import infill as infill_lib
from dlmjax.diffusion import likelihood as likelihood_lib
from dlmjax.diffusion import sampling_config


class EvalModel:
  """A checkpoint with its tokenizer, scoring pairs and decoding prompts (CLI and lm-eval)."""

  def __init__(
    self,
    path: str,
    *,
    settings=likelihood_lib.LikelihoodConfig(),
    sampling=sampling_config.SamplingConfig(),
    tokenizer: str = '',
    seed: int = 0,
    batch_size: int = 8,
    dtype: str | None = None,
  ):
    settings.validate()
    sampling.validate()
    if batch_size < 1:
      raise ValueError(f'batch_size={batch_size} must be positive.')
    self.pretrained = inference.load_pretrained(path, dtype=dtype)
    self.config = config = self.pretrained.config
    m = config.model
    self.mask_id, self.eos_id, self.pad_id = m.mask_token_id, m.eos_token_id, m.pad_token_id
    self.max_length = m.seq_len
    self.tokenizer = (
      tokenizer_lib.load_tokenizer(tokenizer, require_mask=False)
      if tokenizer
      else self.pretrained.tokenizer
    )
    self.settings, self.sampling, self.batch_size = settings, sampling, batch_size
    self.seed, self.key = seed, jax.random.key(seed)
    model_config = self.pretrained.model_config
    if settings.chunk_tokens == 0 and settings.cfg_scale == 0:
      settings = dataclasses.replace(settings, chunk_tokens=m.loss_chunk_tokens)
    self._likelihood_fn = likelihood_lib.make_log_likelihood_fn(
      model_config, settings, mask_id=self.mask_id
    )

  @property
  def chat_template(self) -> str:
    """The template prompts get: the fine-tuning one, except for pre-trained checkpoints."""
    return chat.checkpoint_template(self.config)

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's convention: trailing spaces of the context move to the continuation, and the
    continuation is what the whole text adds to the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self.tokenizer.encode(context + continuation)
    context_ids = self.tokenizer.encode(context) if context else []
    return context_ids, whole[len(context_ids) :]

  def loglikelihood(self, pairs: list[tuple[str, str]]) -> np.ndarray:
    """log p(continuation | context) per text pair, float64 [N]."""
    return self.loglikelihood_tokens([self.encode_pair(c, y) for c, y in pairs])

  def loglikelihood_tokens(self, pairs) -> np.ndarray:
    return likelihood_lib.score_pairs(
      self._likelihood_fn,
      self.pretrained.params,
      pairs,
      key=self.key,
      pad_id=self.pad_id,
      max_length=self.max_length,
      batch_size=self.batch_size,
    )

  def prompt_ids(self, text: str, template: bool = True) -> list[int]:
    """Tokens of a prompt, in the fine-tuning chat template unless template=False."""
    if template and self.chat_template != 'none':
      text = chat.prompt_text(self.chat_template, text)
    return self.tokenizer.encode(text)

  def generate(self, prompts: list[str], sampling=None, *, template: bool = True) -> list[str]:
    """Completions (text up to the first EOS) for each prompt, through the same batched sampler
    as load_pretrained(...).generate (one compilation per prompt width)."""
    self.sampling = (sampling or self.sampling).validate()
    ids = [self.prompt_ids(p, template) for p in prompts]
    rows = self.pretrained.generate_tokens(
      ids, seed=self.seed, batch_size=self.batch_size, **dataclasses.asdict(self.sampling)
    )
    return [self.tokenizer.decode(r) for r in rows]

  def infill(self, examples, hole_tokens: int = 0, sampling=None) -> list[str]:
    """The middle each example's hole gets (dlmjax/diffusion/infill.py): the canvas is
    example.prefix, `hole_tokens` MASK tokens, example.suffix, each encoded apart, no chat
    template. hole_tokens 0: as many as the canonical middle (example.response) has, the
    ground-truth-length oracle of DLM infilling results. EOS and padding the model writes into
    the hole are dropped, so a hole longer than the middle can be padded."""
    self.sampling = (sampling or self.sampling).validate()
    infill_lib.check_settings(self.sampling)
    canvases, spans = [], []
    for e in examples:
      prefix, suffix = self.tokenizer.encode(e.prefix), self.tokenizer.encode(e.suffix)
      n = hole_tokens or max(1, len(self.tokenizer.encode(e.response)))
      canvases.append(prefix + [self.mask_id] * n + suffix)
      spans.append((len(prefix), len(prefix) + n))
    rows = self.pretrained.infill_tokens(
      canvases, seed=self.seed, batch_size=self.batch_size, **dataclasses.asdict(self.sampling)
    )
    drop = (self.eos_id, self.pad_id, self.mask_id)
    return [
      self.tokenizer.decode([t for t in row[a:b] if t not in drop])
      for row, (a, b) in zip(rows, spans)
    ]


# ----------------------------------------------------------------------------------------------
# Modes


def read_rows(path: str) -> list[dict]:
  """The jsonl rows, each checked to be a pair or a multiple-choice item."""
  rows = []
  for number, row in jsonl.read_objects(path, error=ValueError):
    if not isinstance(row.get('context'), str):
      raise ValueError(f'{path}:{number} needs a string "context".')
    if 'choices' in row:
      choices, label = row['choices'], row.get('label')
      if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) for c in choices)
      ):
        raise ValueError(f'{path}:{number}: "choices" must be a list of at least 2 strings.')
      if not isinstance(label, int) or not 0 <= label < len(choices):
        raise ValueError(
          f'{path}:{number}: "label" must be the index of the right choice, 0..{len(choices) - 1}.'
        )
    elif not isinstance(row.get('continuation'), str):
      raise ValueError(
        f'{path}:{number} needs a string "continuation" (or "choices" and '
        '"label" for multiple choice).'
      )
    rows.append(row)
  if not rows:
    raise ValueError(f'{path} has no rows.')
  return rows


def likelihood_mode(model: EvalModel, rows: list[dict]) -> tuple[list[dict], dict]:
  """Per-row results and a summary (log-likelihoods; accuracy for multiple-choice rows)."""
  pairs, owners = [], []
  for index, row in enumerate(rows):
    for choice in row.get('choices', [row.get('continuation')]):
      pairs.append(model.encode_pair(row['context'], choice))
      owners.append(index)
  scores = model.loglikelihood_tokens(pairs)
  results = [dict(row) for row in rows]
  for r in results:
    r['log_likelihoods'] = []
  for owner, score, (_, tokens) in zip(owners, scores, pairs):
    results[owner]['log_likelihoods'].append(float(score))
    results[owner].setdefault('tokens', []).append(len(tokens))
  summary = dict(rows=len(rows), mc_num=model.settings.mc_num, cfg_scale=model.settings.cfg_scale)
  plain = [r for r in results if 'choices' not in r]
  for r in plain:
    r['log_likelihood'], r['tokens'] = r.pop('log_likelihoods')[0], r['tokens'][0]
  if plain:
    total = sum(r['log_likelihood'] for r in plain)
    summary.update(
      pair_rows=len(plain),
      log_likelihood_sum=total,
      log_likelihood_mean=total / len(plain),
      nll_per_token=-total / max(1, sum(r['tokens'] for r in plain)),
    )
  choice_rows = [r for r in results if 'choices' in r]
  for r in choice_rows:
    lls = np.array(r['log_likelihoods'])
    r['prediction'] = int(np.argmax(lls))
    r['prediction_norm'] = int(np.argmax(lls / np.array([max(1, len(c)) for c in r['choices']])))
  if choice_rows:
    summary.update(
      choice_rows=len(choice_rows),
      accuracy=float(np.mean([r['prediction'] == r['label'] for r in choice_rows])),
      accuracy_norm=float(np.mean([r['prediction_norm'] == r['label'] for r in choice_rows])),
    )
  return results, summary


def parse_task_list(text: str) -> list[tuple[str, str]]:
  """'countdown3,math500=test.jsonl' -> [('countdown3', ''), ('math500', 'test.jsonl')]."""
  out = []
  for item in filter(None, (part.strip() for part in text.split(','))):
    name, _, path = item.partition('=')
    out.append((name.strip(), path.strip()))
  return out


def tasks_mode(
  model: EvalModel,
  task_names: list,
  *,
  num: int,
  seed: int,
  samples: int = 1,
  columns: str = '',
  hole_tokens: int = 0,
  allow_unsandboxed_code: bool = False,
):
  """Accuracy, mean reward and the peers' metrics of greedy (or sampled) completions on each
  task's test split; a (name, path) entry reads a file task's test rows from path. An infilling
  task (humaneval_infill) fills each problem's hole instead (EvalModel.infill, `hole_tokens`).

  samples > 1 decodes every problem that many times (each row gets its own sampling noise) and
  averages over all completions: the expected reward under the sampler, which is what RL
  optimises, with less noise than one draw per problem. num=0: every row of a file task."""
  if samples < 1:
    raise ValueError(f'samples={samples}: decode each problem at least once.')
  if hole_tokens < 0:
    raise ValueError(f'--hole-tokens {hole_tokens} must be >= 0 (0: the canonical middle length).')
  results, summary = [], {}
  for entry in task_names:
    name, path = (entry, '') if isinstance(entry, str) else entry
    if name in tasks_lib.FILE_TASKS and not path:
      raise ValueError(f'task {name} reads its test rows from a file: pass --tasks {name}=PATH.')
    task = tasks_lib.get_task(name, data_path=f',{path}' if path else '', columns=columns)
    if isinstance(task, tasks_lib.code.CodeTask):  # what holds its programs, before generating
      task.allow_unsandboxed = allow_unsandboxed_code
      print(task.sandbox(), flush=True)
    examples = task.examples('test', num if path else num or 100, seed) * samples
    if getattr(task, 'infill', False):
      completions = model.infill(examples, hole_tokens)
    else:
      completions = model.generate([e.prompt for e in examples])
    metrics = task.metrics(examples, completions)
    results += [
      dict(
        task=name,
        prompt=e.prompt,
        answer=e.answer,
        completion=c,
        correct=bool(metrics['accuracy'][i]),
        reward=metrics['mean_reward'][i],
      )
      for i, (e, c) in enumerate(zip(examples, completions))
    ]
    summary[name] = dict(
      examples=len(examples) // samples,
      samples=samples,
      **{key: float(np.mean(values)) for key, values in metrics.items()},
    )
  return results, summary


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.evaluate',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--checkpoint-path',
    required=True,
    help=inference.MODEL_PATH_HELP,
  )
  parser.add_argument('--tokenizer', default='', help="default: the run's or the directory's")
  parser.add_argument('--batch-size', type=int, default=8, help='sequences per forward pass')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default=None)
  parser.add_argument('--output', default='', help='per-row results as jsonl')
  sub = parser.add_subparsers(dest='mode', required=True)
  ll = sub.add_parser('likelihood', help='MC log-likelihood of jsonl rows')
  ll.add_argument(
    '--data',
    required=True,
    help='jsonl: {"context", "continuation"} or {"context", "choices", "label"}',
  )
  ll.add_argument('--mc-num', type=int, default=128, help='Monte Carlo samples (LLaDA: 128)')
  ll.add_argument('--mc-batch', type=int, default=32, help='samples per forward (LLaDA: 32)')
  ll.add_argument('--cfg', type=float, default=0.0, help='unsupervised CFG scale')
  tk = sub.add_parser('tasks', help="accuracy on the built-in tasks' test splits or test files")
  tk.add_argument(
    '--tasks',
    default='countdown3,sudoku4,arithmetic',
    help='NAME or NAME=PATH (gsm8k, math500, countdown, sudoku, humaneval, humaneval_infill, '
    'mbpp, kodcode: the test rows)',
  )
  tk.add_argument(
    '--hole-tokens',
    type=int,
    default=0,
    help="humaneval_infill: MASK tokens per hole (0: the canonical middle's length)",
  )
  tk.add_argument(
    '--num', type=int, default=100, help='test examples per task (0: all rows of a file)'
  )
  tk.add_argument('--columns', default='', help="rename file columns: 'problem=question,...'")
  tk.add_argument(
    '--samples',
    type=int,
    default=1,
    help='completions per problem, averaged (with --temperature > 0)',
  )
  tk.add_argument(
    '--allow-unsandboxed-code',
    action='store_true',
    help='code tasks: run the programs where the machine has no OS boundary (bubblewrap), '
    'behind the audit hook and rlimits alone (docs/evaluation.md, Code sandbox)',
  )
  sampling_config.add_arguments(tk)
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.mode == 'likelihood':
      settings = likelihood_lib.LikelihoodConfig(
        mc_num=args.mc_num, mc_batch=args.mc_batch, cfg_scale=args.cfg
      )
      rows = read_rows(args.data)
      model = EvalModel(
        args.checkpoint_path,
        settings=settings,
        tokenizer=args.tokenizer,
        seed=args.seed,
        batch_size=args.batch_size,
        dtype=args.dtype,
      )
      results, summary = likelihood_mode(model, rows)
    else:
      sampling = sampling_config.from_arguments(args)
      model = EvalModel(
        args.checkpoint_path,
        sampling=sampling,
        tokenizer=args.tokenizer,
        seed=args.seed,
        batch_size=args.batch_size,
        dtype=args.dtype,
      )
      results, summary = tasks_mode(
        model,
        parse_task_list(args.tasks),
        num=args.num,
        seed=args.seed,
        samples=args.samples,
        columns=args.columns,
        hole_tokens=args.hole_tokens,
        allow_unsandboxed_code=args.allow_unsandboxed_code,
      )
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if args.output:
    with open(args.output, 'w') as f:
      for row in results:
        f.write(json.dumps(row) + '\n')
  print(json.dumps(summary, indent=2))
  return 0


if __name__ == '__main__':
  sys.exit(main())
