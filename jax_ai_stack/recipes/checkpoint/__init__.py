"""Orbax checkpointing of a whole training job as ONE atomic step.

A step directory holds three items written together: `state` (model parameters,
optimizer state, RNG state: everything `nnx.split` returns), `data` (the Grain
iterator position) and `meta` (the step, the resolved config, the kernel choice,
as JSON). Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it
when complete, so a process killed mid-save never leaves a half step that
`latest_step()` would return; opening a manager removes such leftovers.

One job per module: `manager` (building the manager, background saves that are
never lost at exit, retention), `io` (the state as saved, `save`, shape checks,
layer-layout conversion, partial reads), `recovery` (`restore` and
`read_metadata` past corrupt steps, the error log) and `capture` (stderr while
a corrupt step is read, when the caller asks). The names below load
from them on first use, so a jax-free caller of the package (a config) pays for
no Orbax.

Example:
  >>> import grain
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import checkpoint
  >>> state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  >>> data = iter(grain.MapDataset.range(4).to_iter_dataset())
  >>> with checkpoint.build_manager("checkpoints", CheckpointConfig()) as manager:
  ...   checkpoint.save(manager, 1, state, data, {"step": 1}, force=True)  # In the background.
  ...   restored = checkpoint.restore(manager, nnx.eval_shape(lambda: state), data)  # Waits.
  True
  >>> restored.step, checkpoint.tree_equal(restored.state, state)
  (1, True)
"""

from jax_ai_stack.errors import CheckpointMismatchError
from jax_ai_stack.lazy import lazy_attributes
from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig

_SUBMODULES = ("capture", "io", "manager", "recovery")
_EXPORTS = {
    "ERROR_LOG": "recovery", "TRASH_DIR": "manager", "Manager": "manager",
    "build_manager": "manager", "corruption": "recovery", "read_metadata": "recovery",
    "restore": "recovery", "restore_subset": "io", "save": "io", "tree_equal": "io",
}
__all__ = ["CheckpointConfig", "CheckpointMismatchError", *_SUBMODULES, *_EXPORTS]
__getattr__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)[0]


def __dir__():  # The lazy names and the two that load nothing heavy.
  return sorted(__all__)
