"""jax-ai-stack: a tested, pinned JAX AI stack plus small recipe builders.

Importing this package is cheap: JAX and the libraries load only when a
subpackage (``compat``, ``recipes``, ``kernels``) is first touched.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = (
    "absl_flags", "atomic", "cli", "compat", "determinism", "doctor", "errors", "kernels", "lazy",
    "logs", "recipes", "yamlio",
)
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(__all__)
