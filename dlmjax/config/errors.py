"""The one error a config raises."""


class ConfigError(ValueError):
  """A config that cannot work; the message names the key and the fix."""
