"""The RL batch's row layout: sampler output (left-padded prompt + completion canvas) placed as
right-padded rows [prompt, canvas, pads], with the completion's mask up to its first EOS."""

from __future__ import annotations

import numpy as np


def to_right_padded(
  out_BW, prompt_lengths_B, prompt_width: int, *, eos_id: int, pad_id: int, after_eos='eos'
):
  """Sampler output -> rows [prompt, canvas, pads] of width W, the canvas after its first EOS
  rewritten to EOS (after_eos='eos') or kept as generated ('generated'); also (completion mask
  up to and incl. the first EOS [B, W] float32, lengths [B])."""
  out_BW = np.asarray(out_BW)
  batch, width = out_BW.shape
  gen = width - prompt_width
  tokens = np.full((batch, width), pad_id, np.int32)
  mask = np.zeros((batch, width), np.float32)
  lengths = np.asarray(prompt_lengths_B, np.int32) + gen
  for b in range(batch):
    p = int(prompt_lengths_B[b])
    canvas = out_BW[b, prompt_width:].copy()
    eos = np.flatnonzero(canvas == eos_id)
    end = int(eos[0]) + 1 if len(eos) else gen
    if after_eos == 'eos':
      canvas[end:] = eos_id
    tokens[b, :p] = out_BW[b, prompt_width - p : prompt_width]
    tokens[b, p : p + gen] = canvas
    mask[b, p : p + end] = 1.0
  return tokens, mask, lengths


def steps_right_padded(steps_BG, prompt_lengths_B, width: int):
  """The sampler's commit steps [B, gen] placed like to_right_padded's canvas: int32 [B, W],
  -1 on the prompt and the pads."""
  steps_BG = np.asarray(steps_BG, np.int32)
  steps = np.full((steps_BG.shape[0], width), -1, np.int32)
  for b, p in enumerate(np.asarray(prompt_lengths_B)):
    steps[b, p : p + steps_BG.shape[1]] = steps_BG[b]
  return steps
