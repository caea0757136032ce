"""SFT data: jsonl conversations -> token rows with roles, and the deterministic batch iterator.

A row is prompt + response + EOS, EOS-padded to the canvas (LLaDA: the padding is part of the
answer the model learns to end with), or several conversations packed into one row. Arrays are
[seq_len + 1] like pre-training samples; the loss trains the first seq_len (the canvas), so the
last column is always padding. Batch k takes rows k*GBS .. (k+1)*GBS - 1 of a sequence that
reshuffles every epoch; process p reads its slice (as dlmjax/data/pipeline.py), and the
iterator's state is the number of rows consumed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import grain
import numpy as np

from dlmjax import tasks as tasks_lib
from dlmjax.data import chat
from dlmjax.data import jsonl
from dlmjax.data import pipeline
from dlmjax.data import records
from dlmjax.data import run_tokenizer
from dlmjax.data.errors import DataError
from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from dlmjax.train import choices

TOO_LONG = choices.TOO_LONG  # sft.too_long
BUILTIN_TASKS = ('countdown3', 'countdown4', 'sudoku4', 'arithmetic')
BUILTIN_EXAMPLES_PER_TASK = 1000
BUILTIN_VERSION = 1  # bump when the built-in set's rows change.
BUILTIN_HELD_OUT_PER_TASK = 64  # test-split problems per task for the validation loss
# sft.train_file='builtin:sudoku4[,arithmetic...]': the built-in rows of those tasks alone (a small
# model learns one task in minutes where the four together take far longer).
BUILTIN_PREFIX = 'builtin:'


@dataclasses.dataclass
class Report:
  """What reading an SFT file did (printed at the start of a run)."""

  source: str = ''
  rows: int = 0
  truncated: int = 0
  dropped: int = 0
  tokens: int = 0
  packed_rows: int = 0

  def summary(self) -> str:
    text = (
      f'sft data {self.source}: {self.rows} conversations, {self.tokens:,} tokens; '
      f'{self.truncated} truncated, {self.dropped} dropped as longer than the canvas'
    )
    if self.packed_rows:
      text += f'; packed into {self.packed_rows} rows'
    return text


def read_conversations(path: str, template: str, columns: str = '') -> list[tuple[str, str, str]]:
  """(where, prompt text, response text) of each row, rendered with the template.

  Rows are {"prompt", "response"} (one user turn) or {"messages": [{"role", "content"}, ...]}
  ending with the assistant's response, from jsonl, parquet, json, arrow, csv or a cached hub
  dataset (dlmjax/data/records.py; `columns` renames). A malformed row fails, naming it."""
  if not records.exists(path):
    raise DataError(
      f'no SFT data {path!r}: set --config.sft.train_file to a jsonl/parquet file '
      f'or {records.HUB_PREFIX}NAME.'
    )
  chat.get_template(template)
  out = []
  for where, record in records.read_records(path, columns=columns):
    try:
      if 'messages' in record:
        prompt, response = chat.split_conversation(template, record['messages'])
      elif isinstance(record.get('prompt'), str) and isinstance(record.get('response'), str):
        prompt, response = chat.prompt_text(template, record['prompt']), record['response']
      else:
        raise DataError(
          'a row needs string "prompt" and "response" keys, or "messages" (rename '
          "columns with --config.data.columns='prompt=COL,response=COL')."
        )
    except DataError as e:
      raise DataError(f'{where}: {e}') from e
    if not response.strip():
      raise DataError(
        f'{where}: the response is empty; an SFT row needs an answer to learn '
        '(remove the row or fill it in).'
      )
    out.append((where, prompt, response))
  if not out:
    raise DataError(f'{path} has no rows.')
  return out


def encode_conversations(
  conversations, tokenizer, *, eos_id: int, canvas: int, too_long: str, source: str = ''
) -> tuple[list[tuple[list[int], list[int]]], Report]:
  """[(prompt ids, response ids + EOS)] that fit the canvas, per the too_long policy.

  truncate: cut the response to fill the canvas (no EOS: the answer goes on past the cut); a
  prompt that leaves no room for a response token is dropped. drop: skip the row. error: fail.
  """
  report = Report(source=source)
  prompts = tokenizer.encode_batch([p for _, p, _ in conversations])
  responses = tokenizer.encode_batch([r for _, _, r in conversations])
  out = []
  for (where, _, _), prompt, response in zip(conversations, prompts, responses):
    answer = list(response) + [eos_id]
    length = len(prompt) + len(answer)
    if length > canvas:
      if too_long == 'error':
        raise DataError(
          f'{where}: prompt + response + EOS is {length} tokens, more '
          f'than the canvas model.seq_len={canvas}; raise model.seq_len, shorten '
          'the row, or set --config.sft.too_long=truncate|drop.'
        )
      if too_long == 'drop' or len(prompt) >= canvas:
        report.dropped += 1
        continue
      answer = answer[: canvas - len(prompt)]
      report.truncated += 1
    out.append((list(prompt), answer))
    report.rows += 1
    report.tokens += len(prompt) + len(answer)
  if not out:
    raise DataError(
      f'{source}: every row is longer than the canvas model.seq_len={canvas}; '
      'raise model.seq_len or set --config.sft.too_long=truncate.'
    )
  return out, report


def padded_rows(encoded, *, eos_id: int, width: int) -> dict[str, np.ndarray]:
  """One conversation per row, EOS-padded to `width` (LLaDA): {'tokens', 'roles'} [N, width]."""
  tokens = np.full((len(encoded), width), eos_id, np.int32)
  roles = np.full((len(encoded), width), PADDING, np.int32)
  for i, (prompt, answer) in enumerate(encoded):
    n = len(prompt) + len(answer)
    tokens[i, :n] = prompt + answer
    roles[i, : len(prompt)] = PROMPT
    roles[i, len(prompt) : n] = RESPONSE
  return {'tokens': tokens, 'roles': roles}


def packed_rows(encoded, *, eos_id: int, width: int, canvas: int) -> dict[str, np.ndarray]:
  """Conversations packed in order into rows of `canvas` tokens (a new row when the next one
  does not fit); the tail is padding with segment id 0. {'tokens', 'roles', 'segment_ids'}."""
  rows, current, used = [], [], 0
  for conversation in encoded:
    size = len(conversation[0]) + len(conversation[1])
    if current and used + size > canvas:
      rows.append(current)
      current, used = [], 0
    current.append(conversation)
    used += size
  rows.append(current)
  tokens = np.full((len(rows), width), eos_id, np.int32)
  roles = np.full((len(rows), width), PADDING, np.int32)
  segments = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    start = 0
    for segment, (prompt, answer) in enumerate(row, start=1):
      n = len(prompt) + len(answer)
      tokens[i, start : start + n] = prompt + answer
      roles[i, start : start + len(prompt)] = PROMPT
      roles[i, start + len(prompt) : start + n] = RESPONSE
      segments[i, start : start + n] = segment
      start += n
  return {'tokens': tokens, 'roles': roles, 'segment_ids': segments}


# ----------------------------------------------------------------------------------------------
# The built-in instruction set


def builtin_tasks(path: str) -> tuple[str, ...] | None:
  """The tasks a 'builtin:TASK[,TASK]' train file names; None for any other path."""
  if not path.startswith(BUILTIN_PREFIX):
    return None
  names = tuple(name for name in path[len(BUILTIN_PREFIX) :].split(',') if name)
  unknown = [name for name in names if name not in BUILTIN_TASKS]
  if unknown or not names:
    raise DataError(
      f'sft.train_file {path!r} names no built-in task{" " + ", ".join(unknown) if unknown else ""}'
      f'; write {BUILTIN_PREFIX}TASK[,TASK] with tasks from {", ".join(BUILTIN_TASKS)}.'
    )
  return names


def ensure_builtin_set(
  cache_dir: str, seed: int = 0, split: str = 'train', tasks: tuple[str, ...] = BUILTIN_TASKS
) -> str:
  """The jsonl of the built-in set: worked solutions of `tasks`' problems of `split` ('train'
  for training, 'test' for the validation loss; the tasks split by solution).

  Generated once, offline, into the cache (temporary file, then an atomic rename).
  """
  per_task = BUILTIN_EXAMPLES_PER_TASK if split == 'train' else BUILTIN_HELD_OUT_PER_TASK
  key = [BUILTIN_VERSION, list(tasks), per_task, seed] + ([] if split == 'train' else [split])
  digest = hashlib.md5(json.dumps(key).encode()).hexdigest()[:10]
  path = os.path.join(cache_dir, f'sft-builtin-v{BUILTIN_VERSION}-{digest}.jsonl')
  if os.path.isfile(path):
    return path
  os.makedirs(cache_dir, exist_ok=True)
  rows = [
    {'prompt': example.prompt, 'response': example.response, 'task': task}
    for task in tasks
    for example in tasks_lib.TASKS[task].examples(split, per_task, seed)
  ]
  return jsonl.write_objects(path, rows)


# ----------------------------------------------------------------------------------------------
# Batches


def train_file(config) -> str:
  """sft.train_file, the built-in rows of the tasks it names (builtin:TASK,...), or the whole
  built-in set (data.source=builtin)."""
  named = builtin_tasks(config.sft.train_file)
  if named:
    return ensure_builtin_set(pipeline.cache_dir(config), tasks=named)
  if config.sft.train_file:
    return config.sft.train_file
  if config.data.source != 'builtin':
    raise DataError(
      'stage sft reads sft.train_file, or the built-in set when '
      'data.source=builtin; set --config.sft.train_file=PATH.'
    )
  return ensure_builtin_set(pipeline.cache_dir(config))


def eval_file(config) -> str:
  """sft.eval_file, or the built-in set's held-out problems (data.source=builtin)."""
  if config.sft.eval_file:
    return config.sft.eval_file
  named = builtin_tasks(config.sft.train_file)
  if named:
    return ensure_builtin_set(pipeline.cache_dir(config), split='test', tasks=named)
  if config.sft.train_file or config.data.source != 'builtin':
    raise DataError(
      'eval.every > 0 in stage sft scores a held-out set: set '
      '--config.sft.eval_file=PATH (jsonl like the train file), or '
      '--config.eval.every=0.'
    )
  return ensure_builtin_set(pipeline.cache_dir(config), split='test')


def build_rows(config, log=print, path: str | None = None) -> dict[str, np.ndarray]:
  """Every row of the SFT set (path, default the train file), in file order (packed when
  data.packing)."""
  path = path or train_file(config)
  conversations = read_conversations(path, config.sft.chat_template, config.data.columns)
  canvas = config.model.seq_len
  encoded, report = encode_conversations(
    conversations,
    run_tokenizer.load(config, build=True),
    eos_id=config.model.eos_token_id,
    canvas=canvas,
    too_long=config.sft.too_long,
    source=path,
  )
  if config.data.packing:
    order = np.random.default_rng([config.seed, 1]).permutation(len(encoded))
    rows = packed_rows(
      [encoded[i] for i in order], eos_id=config.model.eos_token_id, width=canvas + 1, canvas=canvas
    )
    report.packed_rows = len(rows['tokens'])
  else:
    rows = padded_rows(encoded, eos_id=config.model.eos_token_id, width=canvas + 1)
  log(report.summary())
  return rows


class EpochRows:
  """Batch k -> this process's rows of it; rows are drawn in a fresh permutation per epoch."""

  def __init__(
    self, rows: dict, global_batch_size: int, local_rows: int, first_row: int, seed: int
  ):
    self.rows, self.global_batch_size = rows, global_batch_size
    self.local_rows, self.first_row, self.seed = local_rows, first_row, seed
    self.num_rows = len(next(iter(rows.values())))
    self._orders = {}

  def _order(self, epoch: int) -> np.ndarray:
    order = self._orders.get(epoch)
    if order is None:
      order = np.random.default_rng([self.seed, 2, epoch]).permutation(self.num_rows)
      self._orders = {**{e: o for e, o in self._orders.items() if e == epoch - 1}, epoch: order}
    return order

  def __call__(self, k: int) -> dict[str, np.ndarray]:
    start = int(k) * self.global_batch_size + self.first_row
    samples = np.arange(start, start + self.local_rows)
    epochs = samples // self.num_rows
    index = np.empty_like(samples)
    for epoch in np.unique(epochs):  # a batch may straddle two epochs.
      chosen = epochs == epoch
      index[chosen] = self._order(int(epoch))[samples[chosen] % self.num_rows]
    return {name: array[index] for name, array in self.rows.items()}


def make_batch_iterator(
  config,
  *,
  process_index: int = 0,
  process_count: int = 1,
  rows: dict | None = None,
  steps: int | None = None,
) -> grain.DatasetIterator:
  """steps (default train.steps) batches of {'tokens', 'roles'(, 'segment_ids')}: int32
  [GBS / P, seq_len + 1].

  Deterministic given the config; get_state() / set_state() as the pre-training iterator.
  """
  global_batch_size = config.train.global_batch_size
  if global_batch_size % process_count:
    raise DataError(
      f'train.global_batch_size {global_batch_size} is not divisible by the '
      f'{process_count} processes; make it a multiple.'
    )
  rows = build_rows(config) if rows is None else rows
  local = global_batch_size // process_count
  batches = grain.MapDataset.range(config.train.steps if steps is None else steps).map(
    EpochRows(rows, global_batch_size, local, process_index * local, config.seed)
  )
  return pipeline.BatchIterator(
    batches, global_batch_size, config.data.prefetch, config.data.num_workers
  )


def make_eval_batch_iterator(config, *, process_index: int = 0, process_count: int = 1):
  """The held-out set (eval_file) as whole global batches, each row scored once per pass."""
  path = eval_file(config)
  rows = build_rows(config, log=lambda line: print(f'held-out {line}'), path=path)
  count = len(rows['tokens'])
  if count < config.train.global_batch_size:
    raise DataError(
      f'{path}: the held-out set has {count} rows, fewer than one global batch '
      f'({config.train.global_batch_size}); add rows or set --config.eval.every=0.'
    )
  return make_batch_iterator(
    config,
    process_index=process_index,
    process_count=process_count,
    rows=rows,
    steps=count // config.train.global_batch_size,
  )
