"""The errors a user's input causes: a config's, and the base every such error shares."""


class UserError(Exception):
  """Input that cannot work as given (a config, a data file, a checkpoint, the machine's room):
  the command lines print the message as one `error: ...` line with exit code 2, no traceback.
  One base at the bottom of the import graph, so they catch it without importing its owners."""


class ConfigError(UserError, ValueError):
  """A config that cannot work; the message names the key and the fix."""
