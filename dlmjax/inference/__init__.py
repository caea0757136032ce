"""`dlmjax.load_pretrained(path)`: a trained model behind numpy in, numpy out.

`path` is an orbax step directory, a run directory (its latest step) or a Hugging Face directory
(any architecture convert reads); the weights go to one device, or to a mesh when given one.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.observability import progress
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import run_model
from dlmjax.data import chat
from dlmjax.data import run_tokenizer
from dlmjax.diffusion import infill as infill_lib
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from dlmjax.model import lora
from dlmjax.model import programs
from dlmjax.parallel import rules

_DTYPE_NAMES = {'fp32': 'float32', 'bf16': 'bfloat16'}
# DiffuCoder-7B-Instruct / -cpGRPO fill the canvas after their answer with this piece, and their
# generate keeps the text before its first occurrence (apple/ml-diffucoder README, "Inference";
# inference_demo.py); a tokenizer that has the piece ends completions there too. Its id comes
# from the checkpoint's own tokenizer.json.
DIFFUCODER_PAD_PIECE = '<|dlm_pad|>'


class Pretrained:
  """Config, params and a jitted forward; `logits` returns the tokenizer's vocabulary."""

  def __init__(self, config, params: dict, source: str = '', mesh=None, model_config=None):
    """model_config: the model `params` are (default: the config's; a LoRA run's adapters)."""
    self.config = config
    self.params = params
    self.source = source
    self.mesh = mesh
    self.model_config = model_config or model_lib.ModelConfig.from_config(config)
    cfg = self.model_config
    self._forward = programs.jit_program(
      lambda p, tokens: model_lib.merge(cfg, p)(tokens), cfg.matmul_dtype
    )

  def _check_token_head(self, use: str) -> None:
    """A reward model (stage reward) ends in a score head: no token logits to return or sample."""
    if self.model_config.score_head:
      raise ValueError(
        f'{self.source or "this checkpoint"} is a reward model (a score head, no token head), so '
        f"it has no {use}; use it as RL's reward (--config.rl.reward_model), or load the "
        'language model it was trained from.'
      )

  @property
  def vocab_size(self) -> int:
    """The tokenizer's vocabulary (config.model.vocab_size), the last axis of `logits`."""
    return self.config.model.vocab_size

  def logits(self, tokens) -> np.ndarray:
    """numpy int tokens [B, L] -> float32 logits [B, L, vocab_size].

    The embedding's padding rows (Megatron pads to a multiple of 128) are cut off: they are never
    real tokens. One compilation per distinct (B, L).
    """
    self._check_token_head('token logits')
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(
        f'tokens must be integers shaped [batch, length], got {tokens.dtype} {tokens.shape}.'
      )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
      raise ValueError(
        f'token ids must lie in [0, {self.vocab_size}); got [{tokens.min()}, {tokens.max()}].'
      )
    logits = self._forward(self.params, tokens.astype(np.int32))
    return np.asarray(jax.device_get(logits[..., : self.vocab_size]), np.float32)

  # ---- Generation (dlmjax/diffusion/sampler.py; `python -m dlmjax.generate` calls these) ----

  @functools.cached_property
  def tokenizer(self):
    """The run's tokenizer: the one in the loaded directory, data.tokenizer or the built-in
    corpus's (data/run_tokenizer.py)."""
    return run_tokenizer.load(self.config, beside=self.source or None)

  @property
  def chat_template(self) -> str:
    """'none' for pre-trained checkpoints, else the template it was fine-tuned with (contract 2)."""
    return chat.checkpoint_template(self.config)

  def generate_tokens(
    self, token_lists, *, seed: int = 0, batch_size: int = 8, **sampling
  ) -> list[list[int]]:
    """Completion token ids (cut before the first EOS) of each prompt's token ids.

    `sampling` holds SamplingConfig fields. Prompts run batch_size at a time, left-padded to the
    longest prompt; the last batch is filled up so one compilation serves every batch.
    """
    self._check_token_head('tokens to generate')
    settings = sampling_config.SamplingConfig.from_values(**sampling).validate()
    m = self.config.model
    if batch_size < 1:
      raise ValueError(f'batch_size must be positive, got {batch_size}.')
    if self.mesh is not None:  # whole batches per batch shard of the mesh.
      shards = int(np.prod([self.mesh.shape[a] for a in rules.RULES[rules.BATCH]]))
      batch_size = -(-batch_size // shards) * shards
    fn = sampler_programs.make_generate_fn(  # lru-cached there: one compilation per setting.
      self.model_config,
      settings,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      mesh=self.mesh,
      vocab_size=m.vocab_size,
    )
    token_lists = [list(t) for t in token_lists]
    width = max((len(t) for t in token_lists), default=0)
    if width + settings.gen_length > m.seq_len:
      raise ValueError(
        f'the longest prompt has {width} tokens; with gen_length '
        f'{settings.gen_length} that exceeds the model context of {m.seq_len} '
        'tokens. Shorten the prompt or gen_length.'
      )
    key = jax.random.key(seed)
    result = []
    for start in progress.track(range(0, len(token_lists), batch_size), 'generate'):
      chunk = token_lists[start : start + batch_size]
      chunk += [chunk[-1]] * (batch_size - len(chunk))
      prompt_BP, lengths_B = prompt_rows.pad_prompts(chunk, m.pad_token_id, width)
      out = fn(self.params, prompt_BP, lengths_B, jax.random.fold_in(key, start))
      rows = prompt_rows.completions(jax.device_get(out), width, m.eos_token_id)
      result += rows[: len(token_lists) - start]
    return result

  def generate(
    self,
    prompts,
    *,
    chat_template: str | None = None,
    seed: int = 0,
    batch_size: int = 8,
    **sampling,
  ) -> list[str]:
    """Completion text of each prompt (a str or a list of them -> a list of str).

    The prompt is wrapped in the checkpoint's chat template (`chat_template` overrides; 'none' =
    raw text) and the completion ends at the first EOS, or before DiffuCoder's padding piece
    (DIFFUCODER_PAD_PIECE) where the tokenizer has it. `sampling` holds SamplingConfig fields.
    """
    self._check_token_head('tokens to generate')
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    template = self.chat_template if chat_template is None else chat_template
    if template != 'none':
      prompts = [chat.prompt_text(template, p) for p in prompts]
    ids = self.tokenizer.encode_batch(prompts)
    rows = self.generate_tokens(ids, seed=seed, batch_size=batch_size, **sampling)
    pad = self.tokenizer.piece_id(DIFFUCODER_PAD_PIECE)
    if pad is not None:
      rows = [r[: r.index(pad)] if pad in r else r for r in rows]
    return [self.tokenizer.decode(r) for r in rows]

  def infill_tokens(
    self, token_lists, *, seed: int = 0, batch_size: int = 8, **sampling
  ) -> list[list[int]]:
    """Each token list with its MASK ids decoded (dlmjax/diffusion/infill.py), the rest kept."""
    self._check_token_head('tokens to infill')
    settings = sampling_config.SamplingConfig.from_values(**sampling).validate()
    m = self.config.model
    if self.mesh is not None:
      raise ValueError('infilling runs on one device; load the checkpoint without a mesh.')
    fn = infill_lib.make_infill_fn(
      self.model_config, settings, mask_id=m.mask_token_id, vocab_size=m.vocab_size
    )
    token_lists = [list(t) for t in token_lists]
    width = max((len(t) for t in token_lists), default=0)
    if width > m.seq_len:
      raise ValueError(f'a template has {width} tokens, more than the context of {m.seq_len}.')
    key, result = jax.random.key(seed), []
    for start in range(0, len(token_lists), batch_size):
      chunk = token_lists[start : start + batch_size]
      chunk += [chunk[-1]] * (batch_size - len(chunk))
      canvas_BL, lengths_B = prompt_rows.pad_prompts(chunk, m.pad_token_id, width)
      out = jax.device_get(fn(self.params, canvas_BL, lengths_B, jax.random.fold_in(key, start)))
      rows = [list(row[width - n :]) for row, n in zip(out.tolist(), lengths_B.tolist())]
      result += rows[: len(token_lists) - start]
    return result

  def infill(self, templates, *, seed: int = 0, batch_size: int = 8, **sampling) -> list[str]:
    """Each template's text with its <mask:N> holes filled (raw text: no chat template)."""
    self._check_token_head('tokens to infill')
    templates = [templates] if isinstance(templates, str) else list(templates)
    mask_id = self.config.model.mask_token_id
    ids = [infill_lib.template_tokens(t, self.tokenizer.encode, mask_id) for t in templates]
    rows = self.infill_tokens(ids, seed=seed, batch_size=batch_size, **sampling)
    return [self.tokenizer.decode(r) for r in rows]


MODEL_PATH_HELP = (
  'run directory (latest step), step directory, Hugging Face directory or hub id '
  'org/name[@revision]'
)


def load_pretrained(
  path: str,
  *,
  dtype: str | None = None,
  mesh=None,
  missing_qk_norm: str = 'error',
  merge_lora: bool = True,
) -> Pretrained:
  """Loads a checkpoint for inference.

  Args:
    path: step directory, run directory (latest step), Hugging Face directory or hub id
      `org/name[@revision]` (checkpoint/hub.py: the cache first, downloaded when online). A LoRA
      run loads as its base with the adapters (checkpoint/run_model.py).
    dtype: compute dtype override ('float32' | 'bfloat16', or 'fp32' | 'bf16'); default: the run's.
    mesh: place params in the mesh's shardings (orbax checkpoints); default: one device.
    missing_qk_norm: for Hugging Face models without QK-norm, see `dlmjax.convert`.
    merge_lora: a LoRA run merged into its base (a plain float32 model, the default), or kept
      as the run computes it: the base in its frozen storage (int8/NF4 stays small) and the
      adapters beside it.
  """
  path = os.path.abspath(hub.resolve(path))
  if hf_io.is_hf_dir(path):
    config, params = hf_io.load_hf(path, missing_qk_norm=missing_qk_norm)
  else:
    run = run_model.restore(path, mesh, merge_lora=merge_lora)
    config, params = run.config, run.params
  if dtype is not None:
    config.model.dtype = _DTYPE_NAMES.get(dtype, dtype)
  if config.model.attention_backend == 'cudnn' and jax.default_backend() != 'gpu':
    config.model.attention_backend = 'xla'  # a GPU run's config, loaded on a CPU.
  # After the overrides above; a LoRA run kept unmerged computes with its adapters.
  model_config = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  return Pretrained(config, params, source=path, mesh=mesh, model_config=model_config)
