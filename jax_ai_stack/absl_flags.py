"""Keeps absl flag parsing away from the user's command line.

Grain's worker processes and tokamax (0.0.12) read absl flags; when nothing has
parsed them, tokamax parses `sys.argv` itself and fails on any argument it does
not know (`UnrecognizedFlagError: Unknown command line flag 'q'` under pytest
-q, or on `jax-ai-stack train --model.num_layers 2`), and grain's workers raise
`UnparsedFlagAccessError`. Marking the flags parsed (keeping their defaults)
avoids both. Call it before using those libraries; it is idempotent.

Example:
  >>> from absl import flags
  >>> ensure_absl_flags_parsed()
  >>> flags.FLAGS.is_parsed()
  True
  >>> ensure_absl_flags_parsed()  # Again: nothing changes.
"""

from absl import flags


def ensure_absl_flags_parsed() -> None:
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
