"""The data.* keys and the chat template, checked where the data is read (registered with
dlmjax.config's validation registry)."""

from __future__ import annotations

from dlmjax.config import ConfigError, registry
from dlmjax.data import chat, tfds_source

# data.source: the built-in corpus, a Megatron blend, or a TFDS dataset (its name and split), as
# data/pipeline.py reads them.
SOURCES = ('builtin', 'megatron', f'{tfds_source.PREFIX}NAME:SPLIT')
registry.choices('sft.chat_template', chat.TEMPLATES)


@registry.check
def data_source(config):
  value = config.data.source
  if value.startswith(tfds_source.PREFIX):
    if len(value.split(':')) != 3 or not all(value.split(':')[1:]):
      raise ConfigError(
        f'data.source={value!r} is not tfds:NAME:SPLIT; set e.g. '
        '--config.data.source=tfds:lm1b:train.'
      )
  elif value not in SOURCES:
    raise ConfigError(
      f'data.source={value!r} is not one of {SOURCES}; set --config.data.source=<one of them>.'
    )


@registry.check
def data_columns(config):
  for item in filter(None, (part.strip() for part in config.data.columns.split(','))):
    ours, _, theirs = item.partition('=')
    if not ours.strip() or not theirs.strip():
      raise ConfigError(
        f'data.columns item {item!r} is not OURS=THEIRS; set e.g. '
        "--config.data.columns='prompt=question,response=answer'."
      )
