"""dlmjax: train masked diffusion language models in JAX, from pre-training through SFT to RL."""

__version__ = '0.1.0'


def __getattr__(name):
  # Lazy, so `import dlmjax` stays light and does not import torch or the model.
  if name == 'load_pretrained':
    from dlmjax.inference import load_pretrained  # pylint: disable=import-outside-toplevel

    return load_pretrained
  raise AttributeError(f'module dlmjax has no attribute {name!r}')
