"""The sinks log.outputs may name, apart from sinks.py that writes them (it imports jax): a
config is checked before jax loads."""

OUTPUTS = ('tensorboard', 'wandb', 'plots')  # log.outputs: where rows go besides metrics.jsonl
