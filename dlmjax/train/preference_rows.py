"""Preference pairs (prompt, chosen, rejected) -> token rows, for VRPO now and a reward model later.

Rows come from the sources SFT reads (jsonl, parquet, json, arrow, csv, a cached hub:NAME;
data.columns renames), rendered with the checkpoint's chat template (sft.chat_template), in the
common layouts:

- {"prompt": str, "chosen": str, "rejected": str};
- chosen / rejected as whole conversations ending in the assistant's reply (UltraFeedback's
  binarised sets): the prompt is the conversation before that reply, the same in both;
- {"prompt": str or [messages], "chosen": [assistant message], "rejected": [...]} (TRL's
  conversational layout).

`pair_rows` gives {'chosen', 'rejected'} [N, seq_len] (prompt + response + EOS, EOS-padded like
SFT rows) and 'prompt_lengths' [N]: a reward stage scores the same rows. The built-in set pairs a
built-in task's worked solution (chosen) with a wrong one (rejected) of a PAIR_KINDS kind,
generated offline into the cache like the SFT set.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np

from dlmjax import tasks
from dlmjax.data import chat, jsonl, records
from dlmjax.data.errors import DataError
from dlmjax.train import sft_rows

BUILTIN_VERSION = 1  # bump when the built-in pairs change.
BUILTIN = 'builtin'  # preference.train_file / eval_file 'builtin[:KIND]' names the built-in pairs
LAYOUTS = (
  'rows need "chosen" and "rejected" (strings with a "prompt" string, or message lists); rename '
  "columns with --config.data.columns='prompt=COL,chosen=COL,rejected=COL'."
)


def _split(template: str, record: dict) -> tuple[str, str, str]:
  """(prompt text, chosen text, rejected text) of one row in any of the layouts."""
  chosen, rejected, prompt = record.get('chosen'), record.get('rejected'), record.get('prompt')
  if isinstance(chosen, str) and isinstance(rejected, str):
    if not isinstance(prompt, str):
      raise DataError('string "chosen" / "rejected" need a string "prompt"; ' + LAYOUTS)
    return chat.prompt_text(template, prompt), chosen, rejected
  if not (isinstance(chosen, list) and isinstance(rejected, list)):
    raise DataError(LAYOUTS)
  context = []
  if isinstance(prompt, list):
    context = prompt
  elif isinstance(prompt, str) and chosen and chosen[0].get('role') != 'user':
    context = [{'role': 'user', 'content': prompt}]
  prompt_w, chosen_text = chat.split_conversation(template, context + chosen)
  prompt_l, rejected_text = chat.split_conversation(template, context + rejected)
  if prompt_w != prompt_l:
    raise DataError(
      'chosen and rejected continue different conversations; a pair shares everything before '
      "the assistant's last reply."
    )
  return prompt_w, chosen_text, rejected_text


def read_pairs(path: str, template: str, columns: str = '') -> list[tuple[str, str, str, str]]:
  """(where, prompt text, chosen text, rejected text) of each row; a malformed row fails, named."""
  if not records.exists(path):
    raise DataError(
      f'no preference data {path!r}: set --config.preference.train_file to a jsonl/parquet '
      f'file or {records.HUB_PREFIX}NAME.'
    )
  chat.get_template(template)
  out = []
  for where, record in records.read_records(path, columns=columns):
    try:
      prompt, chosen, rejected = _split(template, record)
    except DataError as e:
      raise DataError(f'{where}: {e}') from e
    if not chosen.strip() or not rejected.strip():
      raise DataError(f'{where}: an empty chosen or rejected response; fill it in or drop the row.')
    out.append((where, prompt, chosen, rejected))
  if not out:
    raise DataError(f'{path} has no rows.')
  return out


def pair_rows(pairs, tokenizer, *, eos_id: int, canvas: int, too_long: str, log=print) -> dict:
  """{'chosen', 'rejected'} int32 [N, canvas] and 'prompt_lengths' int32 [N]: each side is
  prompt + response + EOS fitted to the canvas by SFT's encoder and rule (sft.too_long); a pair
  is dropped when either side is."""
  flat = [(where, prompt, text) for where, prompt, *sides in pairs for text in sides]
  # Truncating keeps both rows of every pair whose prompt leaves room (the sides share it), so
  # the kept rows stay paired; a side was cut when its answer lost the final EOS. 'error' runs
  # SFT's own check first, which names the row.
  policy = 'error' if too_long == 'error' else 'truncate'
  encoded, _ = sft_rows.encode_conversations(
    flat, tokenizer, eos_id=eos_id, canvas=canvas, too_long=policy, source='pairs'
  )
  keep = [
    (win, lose)
    for win, lose in zip(encoded[0::2], encoded[1::2])
    if too_long != 'drop' or (win[1][-1] == eos_id and lose[1][-1] == eos_id)
  ]
  if not keep:
    raise DataError(
      f'every pair is longer than the canvas model.seq_len={canvas}; raise model.seq_len or '
      'set --config.sft.too_long=truncate.'
    )
  rows_w = sft_rows.padded_rows([w for w, _ in keep], eos_id=eos_id, width=canvas)
  rows_l = sft_rows.padded_rows([lose for _, lose in keep], eos_id=eos_id, width=canvas)
  log(
    f'preference data: {len(keep)} of {len(pairs)} pairs fit the canvas (sft.too_long={too_long})'
  )
  return dict(
    chosen=rows_w['tokens'],
    rejected=rows_l['tokens'],
    prompt_lengths=np.array([len(w[0]) for w, _ in keep], np.int32),
  )


# ----------------------------------------------------------------------------------------------
# The built-in pairs


def _other_problems(task, examples, i, rng) -> str | None:
  """The next problem's solution with a different answer: wrong here, but about another problem,
  a ranking an SFT model gets almost always right."""
  del task, rng
  others = examples[i + 1 :] + examples[:i]
  return next((o.response for o in others if o.answer != examples[i].answer), None)


def _near_miss(task, examples, i, rng) -> str:
  """The problem's own worked solution with a plausible wrong final answer (Task.near_miss):
  telling the two apart takes checking the answer."""
  return task.near_miss(examples[i], rng)


# How the rejected response of a pair is made (task_pairs); the first is the default.
REJECTED = {'other': _other_problems, 'near_miss': _near_miss}
PAIR_KINDS = tuple(REJECTED)


def builtin_kind(spec: str) -> str | None:
  """The pair kind a file setting names ('builtin' -> 'other', 'builtin:KIND' -> KIND), or None
  for a data path; an unknown kind fails in one line."""
  name, _, kind = spec.partition(':')
  if name != BUILTIN:
    return None
  if kind and kind not in PAIR_KINDS:
    raise DataError(f'{spec!r}: the built-in pairs are builtin:KIND, KIND one of {PAIR_KINDS}.')
  return kind or PAIR_KINDS[0]


def ensure_builtin_pairs(
  cache_dir: str, seed: int = 0, split: str = 'train', kind: str = PAIR_KINDS[0]
) -> str:
  """The jsonl of the built-in pairs of `split` and `kind`: for each problem of the built-in SFT
  tasks, its worked solution (chosen) and a wrong one (rejected, task_pairs). Generated once,
  offline, into the cache (temporary file, then an atomic rename)."""
  per_task = (
    sft_rows.BUILTIN_EXAMPLES_PER_TASK if split == 'train' else sft_rows.BUILTIN_HELD_OUT_PER_TASK
  )
  # The default kind keeps its old key, so caches made before kinds existed stay valid.
  key = [BUILTIN_VERSION, sft_rows.BUILTIN_TASKS, per_task, seed, split]
  key += [] if kind == PAIR_KINDS[0] else [kind]
  digest = hashlib.md5(json.dumps(key).encode()).hexdigest()[:10]
  path = os.path.join(cache_dir, f'preference-builtin-v{BUILTIN_VERSION}-{digest}.jsonl')
  if os.path.isfile(path):
    return path
  os.makedirs(cache_dir, exist_ok=True)
  rows = []
  for task in sft_rows.BUILTIN_TASKS:
    rows += task_pairs(task, split, per_task, seed, kind)
  return jsonl.write_objects(path, rows)


def task_pairs(
  task: str, split: str, num: int, seed: int = 0, kind: str = PAIR_KINDS[0]
) -> list[dict]:
  """Pair rows of one task's `num` problems of `split`: each worked solution (chosen) beside a
  wrong response (rejected) of `kind`: the next problem's solution with a different answer
  ('other'), or the problem's own solution with a plausible wrong answer ('near_miss')."""
  if kind not in PAIR_KINDS:
    raise ValueError(f'pair kind {kind!r}: choose one of {PAIR_KINDS}.')
  generator = tasks.TASKS[task]
  examples = generator.examples(split, num, seed)
  rng = random.Random(f'{kind}:{task}:{split}:{seed}')
  rows = []
  for i, example in enumerate(examples):
    rejected = REJECTED[kind](generator, examples, i, rng)
    if rejected is not None:
      rows.append(
        dict(prompt=example.prompt, chosen=example.response, rejected=rejected, task=task)
      )
  return rows
