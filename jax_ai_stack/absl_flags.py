"""Lets grain and tokamax read their absl flags outside `absl.app.run`, touching no other flag.

Both libraries read absl flags as if `absl.app.run` had parsed the command line:

- grain 0.2.18's `mp_prefetch` reads `--grain_enable_multiprocess_worker_profiling`
  from a thread; with nothing parsed it raises `UnparsedFlagAccessError`.
  `grain_flags_readable()` marks grain's own flags as given (what grain does
  in its worker processes), their values unchanged.
- tokamax 0.0.12 hands all of `sys.argv` to absl on first use and raises
  `UnrecognizedFlagError` on the host's arguments (`pytest -q`,
  `jax-ai-stack train --model.num_layers 2`). tokamax 0.0.17 parses only the
  `--tokamax_*` arguments itself; `tokamax_flags_parsed()` does the same on
  0.0.12 and nothing on later versions.

Neither changes a flag's value nor, where the library does not need it, the
parse state: an application that parses its flags later still can.

Example:
  >>> from absl import flags
  >>> grain_flags_readable()
  >>> flags.FLAGS.is_parsed() or flags.FLAGS["grain_py_debug_mode"].present > 0
  True
"""

from __future__ import annotations

import sys
from importlib import metadata

from absl import flags
from packaging.version import Version

TOKAMAX_PARSES_ITS_OWN_FLAGS = Version("0.0.17")
"""The first tokamax that reads only its own `--tokamax_*` arguments (remove with the 0.0.12 rows)."""


def grain_flags_readable() -> None:
  """Grain's flags read without a parse: each is marked given, at its current value."""
  if flags.FLAGS.is_parsed():
    return
  import grain  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import  (defines them)

  for name in flags.FLAGS:
    if name.startswith("grain_") and not flags.FLAGS[name].present:
      flags.FLAGS[name].present = 1


def tokamax_flags_parsed() -> None:
  """On tokamax < 0.0.17: parse only the `--tokamax_*` arguments, as later versions do."""
  if flags.FLAGS.is_parsed() or Version(metadata.version("tokamax")) >= TOKAMAX_PARSES_ITS_OWN_FLAGS:
    return
  from tokamax._src import config  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import  (defines them)

  own = [arg for arg in sys.argv[1:] if arg.startswith("--tokamax_")]
  flags.FLAGS([*(sys.argv[:1] or ["python"]), *own], known_only=True)
