"""The one exception the data pipeline raises for bad inputs, so callers can catch data problems."""

from dlmjax.config.errors import UserError


class DataError(UserError, ValueError):
  """Data that cannot be used as given; the message names the file and the fix."""
