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
a corrupt step is read). The names below are re-exported from them.

Example:
  >>> import grain
  >>> from flax import nnx
  >>> state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  >>> data = iter(grain.MapDataset.range(4).to_iter_dataset())
  >>> with build_manager("checkpoints", CheckpointConfig()) as manager:
  ...   save(manager, 1, state, data, {"step": 1}, force=True)  # In the background.
  ...   restored = restore(manager, nnx.eval_shape(lambda: state), data)  # Waits for it.
  True
  >>> restored.step, tree_equal(restored.state, state)
  (1, True)
"""

from jax_ai_stack.errors import CheckpointMismatchError
from jax_ai_stack.recipes.checkpoint.io import restore_subset, save, tree_equal
from jax_ai_stack.recipes.checkpoint.manager import TRASH_DIR, Manager, build_manager
from jax_ai_stack.recipes.checkpoint.recovery import ERROR_LOG, corruption, read_metadata, restore
from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig

__all__ = [
    "ERROR_LOG", "TRASH_DIR", "CheckpointConfig", "CheckpointMismatchError", "Manager",
    "build_manager", "corruption", "read_metadata", "restore", "restore_subset", "save",
    "tree_equal",
]
