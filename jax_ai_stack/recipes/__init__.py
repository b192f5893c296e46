"""Recipe builders: each returns the library's own object (an `nnx.Module`, an
`optax.GradientTransformation`, a Grain dataset, an Orbax `CheckpointManager`).

Submodules load on first use, so `from jax_ai_stack import recipes` stays cheap.
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = (
    "checkpoint", "checkpoint_config", "cli", "config", "configlib", "data", "distributed",
    "memory", "metrics", "models", "optim", "optim_config", "sharding", "sharding_config",
    "step", "tasks", "train",
)
__all__ = list(_SUBMODULES)
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES)
