"""Supervised fine-tuning of a pre-trained model with LLaDA's recipe, on the built-in task set.

    python -m dlmjax.train --config=configs/tiny.py           # pre-train: writes runs/tiny
    python -m dlmjax.train --config=configs/sft.py [--config.init_from=runs/tiny]
    python -m dlmjax.train --config=configs/sft.py:lora   # LoRA adapters: runs/sft_lora
    python -m dlmjax.distill --init-from runs/sft --output runs/teacher_rows.npz   # distillation:
    python -m dlmjax.train --config=configs/sft.py:certainty   # dParallel -> runs/distill_certainty
    python -m dlmjax.summary --config=configs/sft.py:llada_8b --config.train.lora.rank=128 \
      --config.model.seq_len=2048 --config.model.remat=full --config.model.dtype=bfloat16 \
      --devices=1 --device-kind=H100   # what a LoRA SFT of LLaDA-8B needs on one 80 GB GPU

The model (architecture, tokenizer, special ids) comes from `init_from`: a dlmjax run or step
directory, or a Hugging Face directory. The data is the built-in 4x4 sudoku set (1000 worked
solutions of dlmjax.tasks' sudoku4 train split, generated offline into the cache): the one built-in
task the quick-start model learns in minutes (the four tasks together stay at chance for longer).
Give your own with --config.sft.train_file=data.jsonl (rows {"prompt", "response"} or
{"messages": [...]}); builtin:countdown3,countdown4,sudoku4,arithmetic names built-in tasks.
Responses are EOS-padded to the canvas (model.seq_len) and the padding is learnt, so the model
learns where to stop. From the quick-start runs/tiny with --config.model.seq_len=80 (the sudoku
rows' canvas; at 128 the padding outweighs the answer and learning is ~2x slower), on the shared
2-core CPU, 3-5 minutes: held-out sudoku4 (`python -m dlmjax.evaluate ... tasks --tasks sudoku4
--gen-length 32 --steps 32 --block-length 32`) accuracy 0.56, share of blanks right 0.85 (chance
0.25) for the default seed; --config.seed=1 reached 0.02 / 0.36 (the curve: docs/benchmarks.md
"Tiny config on the CPU").
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  c = config_lib.defaults()
  names = [a for a in (arg or '').split(',') if a]
  recipes = ('lora', *DISTILL_OBJECTIVES)
  for preset in [n for n in names if n not in recipes]:  # configs/sft.py:PRESET (for summary)
    config_lib.apply_preset(c.model, preset)
  c.stage = 'sft'
  c.init_from = 'runs/tiny'
  c.output_dir = 'runs/sft'
  c.sft.chat_template = 'plain'
  c.sft.train_file = 'builtin:sudoku4'
  c.train.steps = 480
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.lr = 2e-3
  c.train.min_lr = 2e-4
  c.train.warmup_steps = 10
  c.train.wsd_decay_steps = 48  # LLaDA decays over the final 10% of SFT.
  c.checkpoint.every = 160
  c.log.every = 10
  if 'lora' in names:  # configs/sft.py:lora[,PRESET]: adapters on the frozen init_from model
    _lora(c)
  for objective in [n for n in names if n in DISTILL_OBJECTIVES]:
    _distill(c, objective)
  return c


DISTILL_OBJECTIVES = ('certainty', 'trajectory')  # dParallel's, d3LLM's (README "Distillation")


def _distill(c, objective):
  # configs/sft.py:certainty | trajectory: the SFT run distilled on its own decoding (the rows of
  # `python -m dlmjax.distill --init-from runs/sft --output runs/teacher_rows.npz`).
  c.init_from = 'runs/sft'
  c.output_dir = f'runs/distill_{objective}'
  c.sft.objective = objective
  c.sft.teacher_file = 'runs/teacher_rows.npz'
  # A short fine-tune of an already fine-tuned model at a tenth of its rate (dParallel: 2e-5 on
  # LLaDA-8B, a tenth of LLaDA's SFT rate too).
  c.train.steps = 50
  c.train.lr = 1e-4
  c.train.min_lr = 1e-5
  c.train.warmup_steps = 5
  c.train.wsd_decay_steps = 5


def _lora(c):
  # Its own run directory: the full SFT run above writes runs/sft, which a LoRA run cannot resume.
  c.output_dir = 'runs/sft_lora'
  c.train.lora.rank = 16
  c.train.lora.alpha = 32.0
  # Adapters start at zero (B = 0) and move the model only through the low-rank product xAB, so
  # at full fine-tuning's rate they barely move in a short run: measured from a 40-step tiny
  # base on the 2-core CPU, 20 steps of rank 8 took masked CE 7.69 -> 7.21 at lr 1e-3 and
  # 7.69 -> 4.35 at 1e-2. Hence 10x the full SFT rate. (On the quick-start sudoku set even that
  # is not enough: 480 steps of rank 16 at 2e-2 reach masked CE 2.3, held-out reward 0.)
  c.train.lr = 2e-2
  c.train.min_lr = 2e-3
