"""The package's user-facing errors: bad input, not bugs.

The command line prints any `UserError` as one line and exits 2; every other
exception is a bug in the package (or a library) and keeps its traceback
(exit 1). Raise one of these only when the user can fix the cause, and say
how: name the config field, the file, the package and version.

This module imports nothing, so every part of the package can use it.

Example:
  >>> try:
  ...   raise ConfigError("train.steps must be >= 1, got 0")
  ... except UserError as e:
  ...   print(e)
  train.steps must be >= 1, got 0
"""


class UserError(Exception):
  """Bad input the user can fix; the message says what and where."""


class UsageError(UserError):
  """Command-line arguments that do not fit together or do not parse."""


class ConfigError(UserError, ValueError):
  """A recipe config that does not validate; names the field, value and source."""


class DataError(UserError, ValueError):
  """Data that cannot be read or is too small; names the file or the field."""


class WorkdirError(UserError, ValueError):
  """A workdir that cannot be used (a file, not writable, no checkpoint, another run)."""


class CheckpointMismatchError(WorkdirError):
  """The checkpoint in the workdir does not fit the model the config builds."""


class ModelFileError(UserError, ValueError):
  """A model directory (Hugging Face config.json, safetensors) that cannot be read or used."""


class MissingExtraError(UserError, ImportError):
  """An optional package is not installed; names the extra that installs it."""
