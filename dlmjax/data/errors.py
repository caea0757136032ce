"""The one exception the data pipeline raises for bad inputs, so callers can catch data problems."""


class DataError(ValueError):
  """Data that cannot be used as given; the message names the file and the fix."""
