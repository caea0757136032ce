"""Stages plug a batch source and a loss into the shared step; nothing else differs."""

from dlmjax.train.stages import pretrain

STAGES = {'pretrain': pretrain}
