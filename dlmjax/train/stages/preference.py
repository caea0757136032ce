"""Preference alignment: VRPO (LLaDA 1.5, arXiv 2505.19223), DPO over ELBO estimates of the
chosen and the rejected response under the policy and a frozen reference (dlmjax/rl/vrpo.py).

A stage of its own, not an rl.objective: RL's objectives are declared around rollouts (what the
sampler records, rewards, group advantages, old-policy ratios, inner updates), and VRPO has none
of them: it reads fixed pairs, like SFT, and needs only the reference's ELBOs beside each batch.
So its keys are a group of their own, preference.* (not rl.vrpo.*); the reference is RL's
(rl/reference.py: the init model in rl.reference_dtype, or a LoRA run's base with the adapters
off), scored by the batch source before each step as RL's rollout scores it.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.data import pipeline, records, run_tokenizer
from dlmjax.data.errors import DataError
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import budget, vrpo
from dlmjax.train import preference_rows, sft_rows
from dlmjax.train.stages import base

KEYS = ('tokens', 'rejected', 'prompt_lengths', 'mask_seeds', 'ref_chosen', 'ref_rejected')


def settings(config) -> dict:
  """The ELBO's static settings (one compiled program per distinct set)."""
  p = config.preference
  n_time, n_mask = budget.allocation(p.budget, p.n_time)
  return dict(
    n_time=n_time,
    n_mask=n_mask,
    mask_id=config.model.mask_token_id,
    chunk_size=config.model.loss_chunk_tokens,
  )


def pair_elbos(module, chosen_BL, rejected_BL, prompt_lengths_B, keys_B, settings: dict):
  """(B-hat(chosen) [B], B-hat(rejected) [B]) in one forward of 2B rows per masked copy, the two
  sides of a pair with the same draws."""
  both = vrpo.elbo(
    module,
    jnp.concatenate([chosen_BL, rejected_BL]),
    jnp.concatenate([prompt_lengths_B, prompt_lengths_B]),
    jnp.concatenate([keys_B, keys_B]),
    **settings,
  )
  return jnp.split(both, 2)


def make_loss(config):
  """loss(module, tokens=, rejected=, prompt_lengths=, mask_seeds=, ref_chosen=, ref_rejected=)
  -> (objective, sums): the pairs' DPO loss summed over the global batch's rows (each
  micro-batch's share of the step's mean)."""
  bound, p = settings(config), config.preference
  global_rows = config.train.global_batch_size

  def fn(module, *, step=None, micro_index=None, example_ids_B=None, **arrays):
    del step, micro_index, example_ids_B  # the draws come from the rows' mask seeds
    keys_B = vrpo.row_keys(config.seed, arrays['mask_seeds'], vrpo.POLICY_STREAM)
    chosen_B, rejected_B = pair_elbos(
      module, arrays['tokens'], arrays['rejected'], arrays['prompt_lengths'], keys_B, bound
    )
    loss_B, margin_B = vrpo.dpo_loss(
      chosen_B, rejected_B, arrays['ref_chosen'], arrays['ref_rejected'], beta=p.beta
    )
    return jnp.sum(loss_B) / global_rows, pair_sums(loss_B, margin_B, arrays)

  return fn


def pair_sums(loss_B, margin_B, arrays) -> dict:
  """A micro-batch's sums of a loss over pairs (this stage's and the reward stage's): losses,
  margins, pairs ranked right, rows, and the tokens scored (both sides' completions)."""
  width = arrays['tokens'].shape[1]
  return dict(
    loss_sum=jnp.sum(loss_B),
    margin_sum=jnp.sum(margin_B),
    correct_sum=jnp.sum((margin_B > 0).astype(jnp.float32)),
    rows=jnp.float32(loss_B.shape[0]),
    tokens=jnp.sum(2.0 * (width - arrays['prompt_lengths'])).astype(jnp.float32),
  )


def pair_metrics(sums, accuracy: str) -> dict:
  """The step's metrics from pair_sums; `accuracy` names the share of pairs ranked right."""
  rows = jnp.maximum(sums['rows'], 1.0)
  return {
    'loss': sums['loss_sum'] / rows,
    'margin': sums['margin_sum'] / rows,
    accuracy: sums['correct_sum'] / rows,
    'tokens': sums['tokens'],
  }


def metrics(sums) -> dict:
  return pair_metrics(sums, 'preference_accuracy')


@functools.lru_cache(maxsize=8)  # one compilation per model and estimator, whatever the seed
def _score_program(model_config, settings_items):
  def fn(params, chosen, rejected, prompt_lengths, keys):
    params = programs.as_float32_params(params, model_config.matmul_dtype)
    module = model_lib.merge(model_config, params)
    return pair_elbos(module, chosen, rejected, prompt_lengths, keys, dict(settings_items))

  return programs.jit_program(fn, model_config.matmul_dtype)


class Scorer:
  """The pairs' ELBOs under given params (no gradients) on the run's mesh, a micro-batch of
  rows at a time: each row's draws are its own (its mask seed), so the slices score what the
  whole batch would, in the training step's activation memory (the whole batch at once, 2 x
  budget copies of every row, outgrew an 80 GB GPU at the 8B shape: docs/preference.md)."""

  def __init__(self, config, setup, model_config):
    self.config, self.setup = config, setup
    self.program = _score_program(model_config, tuple(sorted(settings(config).items())))
    self.rows = max(1, config.train.micro_batch_size // jax.process_count())

  def __call__(self, params, batch, stream: int):
    keys = vrpo.row_keys(self.config.seed, jnp.asarray(batch['mask_seeds']), stream)
    count = len(batch['tokens'])
    size = self.rows if count % self.rows == 0 else count
    parts = []
    with rules.activation_mesh(self.setup.mesh):
      for start in range(0, count, size):
        rows = slice(start, start + size)
        parts.append(
          self.program(
            params,
            batch['tokens'][rows],
            batch['rejected'][rows],
            batch['prompt_lengths'][rows],
            keys[rows],
          )
        )
      return distributed.to_host(jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts))


# The start line's name for the reference: the B_ref of each ELBO in the DPO loss, not a KL term.
REFERENCE_ROLE = 'frozen VRPO reference model (B_ref in the DPO loss)'


def reference_stream(config) -> int:
  """Antithetic sampling: the reference draws the policy's timesteps and masks."""
  return vrpo.POLICY_STREAM if config.preference.antithetic else vrpo.INDEPENDENT_REFERENCE_STREAM


class PairBatches:
  """The stage's BatchSource: this process's pairs of each global batch, with the reference's
  ELBOs for their draws (mask seed = the row's index in the run's sample sequence). Without a
  reference (the reward stage), the pairs alone, as `keys` names them."""

  def __init__(
    self,
    config,
    setup,
    reference,
    rows: dict,
    *,
    process_index: int,
    process_count: int,
    keys: tuple[str, ...] = KEYS,
  ):
    self.config, self.reference, self.keys = config, reference, keys
    self.scorer = None if reference is None else Scorer(config, setup, reference.model_config)
    gbs = config.train.global_batch_size
    if gbs % process_count:
      raise DataError(
        f'train.global_batch_size {gbs} is not divisible by the {process_count} processes.'
      )
    self.local, self.first = gbs // process_count, process_index * (gbs // process_count)
    self.read = sft_rows.EpochRows(rows, gbs, self.local, self.first, config.seed)
    self.step = 0

  def next(self, params):
    del params
    start = time.time()
    rows = self.read(self.step)
    gbs = self.config.train.global_batch_size
    seeds = np.arange(self.local, dtype=np.int32) + self.step * gbs + self.first
    batch = dict(
      tokens=rows['chosen'],
      rejected=rows['rejected'],
      prompt_lengths=rows['prompt_lengths'],
      mask_seeds=seeds,
    )
    self.step += 1
    if self.scorer is None:
      return {k: batch[k] for k in self.keys}, None
    ref_w, ref_l = self.scorer(self.reference.params(), batch, reference_stream(self.config))
    batch.update(ref_chosen=np.asarray(ref_w), ref_rejected=np.asarray(ref_l))
    return batch, dict(step=self.step, reference_s=time.time() - start)

  def get_state(self) -> dict:
    return dict(step=self.step)

  def set_state(self, state: dict) -> None:
    self.step = int(state['step'])


def held_out_batches(config, rows: dict):
  """The first eval.batches global batches of held-out pairs (whole batches only)."""
  gbs = config.train.global_batch_size
  count = min(len(rows['chosen']), config.eval.batches * gbs)
  for start in range(0, count - gbs + 1, gbs):
    yield dict(
      tokens=rows['chosen'][start : start + gbs],
      rejected=rows['rejected'][start : start + gbs],
      prompt_lengths=rows['prompt_lengths'][start : start + gbs],
      mask_seeds=np.arange(start, start + gbs, dtype=np.int32) + config_lib.EVAL_SEED,
    )


class HeldOutPreference:
  """The stage's Evaluator: margin and preference accuracy (margin > 0) on held-out pairs, the
  same draws (config.EVAL_SEED) at every evaluation."""

  def __init__(self, config, setup, reference, rows: dict):
    self.config, self.rows, self.reference = config, rows, reference
    self.ref_scorer = Scorer(config, setup, self.reference.model_config)
    self.scorer = Scorer(config, setup, setup.model_config)
    self._ref = None

  def batches(self):
    return held_out_batches(self.config, self.rows)

  def margins(self, params) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each held-out pair's margin under `params`, and B(y_w) - B(y_l) under `params` and under
    the reference (whose ELBOs are scored once)."""
    if self._ref is None:
      stream, reference = reference_stream(self.config), self.reference.params()
      self._ref = [self.ref_scorer(reference, b, stream) for b in self.batches()]
    margins, gaps, ref_gaps = [], [], []
    for batch, (ref_win, ref_lose) in zip(self.batches(), self._ref):
      win, lose = self.scorer(params, batch, vrpo.POLICY_STREAM)
      margins.append(vrpo.dpo_loss(win, lose, ref_win, ref_lose, beta=1.0)[1])
      gaps.append(np.asarray(win) - np.asarray(lose))
      ref_gaps.append(np.asarray(ref_win) - np.asarray(ref_lose))
    return np.asarray(jnp.concatenate(margins)), np.concatenate(gaps), np.concatenate(ref_gaps)

  def run(self, step: int, params) -> dict:
    margins, gaps, ref_gaps = self.margins(params)
    row = dict(
      step=step,
      val_margin=float(margins.mean()),
      val_preference_accuracy=float((margins > 0).mean()),
      # Whether the model itself ranks chosen above rejected (no reference): the policy's, and
      # the reference's (the model before alignment).
      val_elbo_accuracy=float((gaps > 0).mean()),
      val_reference_elbo_accuracy=float((ref_gaps > 0).mean()),
      val_pairs=len(margins),
    )
    if jax.process_index() == 0:
      print(
        f'step {step}: val_margin {row["val_margin"]:.4f} | val_preference_accuracy '
        f'{row["val_preference_accuracy"]:.4f} | val_elbo_accuracy {row["val_elbo_accuracy"]:.4f} '
        f'(reference {row["val_reference_elbo_accuracy"]:.4f}; {row["val_pairs"]} held-out pairs)',
        flush=True,
      )
    return row


def train_file(config) -> str:
  """preference.train_file, or the built-in pairs: 'builtin[:KIND]', or '' with
  data.source=builtin (the default kind)."""
  path = config.preference.train_file
  kind = preference_rows.builtin_kind(path or preference_rows.BUILTIN)
  if path and kind is None:
    return path
  if not path and config.data.source != 'builtin':
    raise DataError(
      f'stage {config.stage} reads preference.train_file, or the built-in pairs when '
      'data.source=builtin; set --config.preference.train_file=PATH.'
    )
  return preference_rows.ensure_builtin_pairs(pipeline.cache_dir(config), kind=kind)


def eval_file(config) -> str:
  """preference.eval_file, or the built-in pairs' held-out split: 'builtin[:KIND]', or '' when
  the training pairs are the built-in ones (of their kind)."""
  path = config.preference.eval_file
  train = config.preference.train_file or ('' if config.data.source != 'builtin' else 'builtin')
  kind = preference_rows.builtin_kind(path or train)
  if path and kind is None:
    return path
  if kind is None:
    raise DataError(
      f'eval.every > 0 in stage {config.stage} scores held-out pairs: set '
      '--config.preference.eval_file=PATH, or --config.eval.every=0.'
    )
  return preference_rows.ensure_builtin_pairs(pipeline.cache_dir(config), split='test', kind=kind)


def build_rows(config, path: str, log=print) -> dict:
  pairs = preference_rows.read_pairs(path, config.sft.chat_template, config.data.columns)
  return preference_rows.pair_rows(
    pairs,
    run_tokenizer.load(config, build=True),
    eos_id=config.model.eos_token_id,
    canvas=config.model.seq_len,
    too_long=config.sft.too_long,
    log=log,
  )


def stage(config) -> base.Stage:
  """The preference stage (its keys are checked with the config: train/config_checks.py)."""
  # The batch source and the evaluator share one reference (restored once).
  reference = functools.cache(
    lambda setup: reference_lib.ReferenceModel(config, setup, role=REFERENCE_ROLE)
  )

  def batches(setup, process_index, process_count):
    return PairBatches(
      config,
      setup,
      reference(setup),
      build_rows(config, train_file(config)),
      process_index=process_index,
      process_count=process_count,
    )

  def evaluator(setup):
    rows = build_rows(config, eval_file(config), log=lambda line: print(f'held-out {line}'))
    return HeldOutPreference(config, setup, reference(setup), rows)

  def example_batch(rng):
    rows = config.train.global_batch_size
    return dict(
      example_pairs(config, rng),
      mask_seeds=np.arange(rows, dtype=np.int32),
      ref_chosen=rng.standard_normal(rows).astype(np.float32),
      ref_rejected=rng.standard_normal(rows).astype(np.float32),
    )

  return base.Stage(
    name='preference',
    loss=make_loss(config),
    batch_keys=KEYS,
    metrics=metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=example_batch,
    console_metrics=('margin', 'preference_accuracy', 'reference_s'),
    check_inputs=lambda: check_files(config),
    loss_is_objective=True,
    resident_param_bytes=(
      0.0
      if config.train.lora.rank or config.rl.reference_on_host
      else float(jnp.dtype(config.rl.reference_dtype).itemsize)
    ),
    data_keys=PAIR_DATA_KEYS,
  )


# A run's data identity on preference pairs (this stage's and the reward stage's).
PAIR_DATA_KEYS = (
  'data.source',
  'preference.train_file',
  'data.columns',
  'sft.chat_template',
  'sft.too_long',
  'model.seq_len',
  'seed',
)


def example_pairs(config, rng) -> dict:
  """A global batch of random pairs: a prompt of a quarter of the canvas, the responses after."""
  rows, width = config.train.global_batch_size, config.model.seq_len
  return dict(
    tokens=base.random_tokens(config, rng, (rows, width)),
    rejected=base.random_tokens(config, rng, (rows, width)),
    prompt_lengths=np.full((rows,), width // 4, np.int32),
  )


def check_files(config) -> None:
  """A run starts from a fine-tuned model, and preference.train_file, when given, exists."""
  if not config.init_from:
    raise config_lib.ConfigError(
      f'stage {config.stage} starts from a fine-tuned model: set --config.init_from to a dlmjax '
      'run or step directory (an SFT run) or a Hugging Face directory.'
    )
  path = config.preference.train_file
  if path and preference_rows.builtin_kind(path) is None and not records.exists(path):
    raise DataError(
      f'preference.train_file {path!r} is not a file; set --config.preference.train_file to a '
      'jsonl/parquet of {"prompt", "chosen", "rejected"} rows, or hub:NAME.'
    )
