"""Supervised fine-tuning of a pre-trained model with LLaDA's recipe, on the built-in task set.

    python -m dlmjax.train --config=configs/tiny.py           # pre-train: writes runs/tiny
    python -m dlmjax.train --config=configs/sft.py [--config.init_from=runs/tiny]
    python -m dlmjax.summary --config=configs/sft.py:llada_8b --config.train.lora.rank=128 \
      --config.model.seq_len=2048 --config.model.remat=full --config.model.dtype=bfloat16 \
      --devices=1 --device-kind=H100   # what a LoRA SFT of LLaDA-8B needs on one 80 GB GPU

The model (architecture, tokenizer, special ids) comes from `init_from`: a dlmjax run or step
directory, or a Hugging Face directory. The built-in instruction set is worked solutions of the
RL tasks (countdown, 4x4 sudoku, arithmetic), generated offline into the cache; give your own
with --config.sft.train_file=data.jsonl (rows {"prompt", "response"} or {"messages": [...]}).
Responses are EOS-padded to the canvas (model.seq_len) and the padding is learnt, so the model
learns where to stop. Measured from runs/tiny on the 2-core CPU (shared with other jobs, ~180
tokens/s): the loss (per answer length, LLaDA) was 5.5 at step 10, 2.2 at step 20 and 1.14 at
step 30 (the run was stopped there).
"""

from dlmjax import config as config_lib
from dlmjax.model import presets


def get_config(arg=None):
  c = config_lib.defaults()
  if arg:  # configs/sft.py:PRESET sets the model keys of a preset (e.g. for summary)
    presets.apply_preset(c.model, arg)
  c.stage = 'sft'
  c.init_from = 'runs/tiny'
  c.output_dir = 'runs/sft'
  c.sft.chat_template = 'plain'
  c.train.steps = 100
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.lr = 1e-3
  c.train.min_lr = 1e-4
  c.train.warmup_steps = 10
  c.train.wsd_decay_steps = 10  # LLaDA decays over the final 10% of SFT.
  c.checkpoint.every = 50
  c.log.every = 10
  return c
