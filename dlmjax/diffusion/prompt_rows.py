"""The caller's layout of a sampled batch: token lists left-padded into one prompt array, and
each row's completion cut back out at its first EOS (host-side numpy, outside the compiled
sampler)."""

from __future__ import annotations

import numpy as np


def pad_prompts(token_lists, pad_id: int, width: int | None = None):
  """Left-pads token lists to one width: (prompt_BP int32, prompt_lengths_B int32), numpy."""
  lengths = np.array([len(t) for t in token_lists], np.int32)
  longest = int(lengths.max()) if len(lengths) else 0
  width = longest if width is None else width
  if width < longest:
    raise ValueError(f'a prompt has {longest} tokens, more than width={width}; raise the width.')
  prompt_BP = np.full((len(token_lists), width), pad_id, np.int32)
  for row, tokens in enumerate(token_lists):
    if len(tokens):
      prompt_BP[row, width - len(tokens) :] = tokens
  return prompt_BP, lengths


def completions(out_BL, prompt_width: int, eos_id: int) -> list[list[int]]:
  """The generated tokens of each row, cut before the first EOS."""
  result = []
  for row in np.asarray(out_BL)[:, prompt_width:]:
    eos = np.flatnonzero(row == eos_id)
    result.append(row[: eos[0] if len(eos) else len(row)].tolist())
  return result
