"""Stages plug a batch source and a loss into the shared step; nothing else differs.

A stage module provides loss_fn(config), batch_iterator(config, *, process_index,
process_count), batch_keys(config) (the batch's arrays, all [global_batch_size, ...] rows) and
metrics(sums) (the step's scalar metrics, with at least `loss` and `tokens`, from the loss's
sums accumulated over micro-batches).
"""

from dlmjax.train.stages import pretrain, rl, sft

STAGES = {'pretrain': pretrain, 'sft': sft, 'rl': rl}
