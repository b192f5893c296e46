"""Recipe builders: each returns the library's own object (an `nnx.Module`, an
`optax.GradientTransformation`, a Grain dataset, an Orbax `CheckpointManager`).

Submodules load on first use, so `from jax_ai_stack import recipes` stays cheap.
"""

import importlib

_SUBMODULES = (
    "checkpoint",
    "cli",
    "config",
    "configlib",
    "data",
    "metrics",
    "models",
    "optim",
    "step",
    "tasks",
    "train",
)
__all__ = list(_SUBMODULES)


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(__all__)
