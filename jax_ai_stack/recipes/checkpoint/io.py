"""The state as Orbax saves it, one step's save, and reading a state or part of one.

`save` writes the state, the data position and the metadata as one step.
Reading checks shapes first (a config that does not fit the checkpoint names
the parameter and both shapes, and touches nothing) and converts a step saved
with the other Llama layer layout (`model.scan_layers` flipped: `layers/N/...`
vs stacked `layers/...`, parameters and optimizer moments alike; see
`models.layer_stack`) after reading it as saved.

Example:
  >>> import numpy as np
  >>> tree_equal({"w": np.zeros(3)}, {"w": np.zeros(3)}), tree_equal({"w": np.zeros(3)}, {"w": np.ones(3)})
  (True, False)
"""

from __future__ import annotations

import functools
import logging
import pathlib
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from jax_ai_stack.errors import CheckpointMismatchError
from jax_ai_stack.recipes.checkpoint.manager import Manager, _empty_trash
from jax_ai_stack.recipes.models import layer_stack

log = logging.getLogger(__name__)


def _savable(state: nnx.State, key_data=jax.random.key_data) -> dict:
  """Pure nested dict of arrays; typed PRNG keys become their raw key data.

  Integer keys (list indices) stay integers: Orbax stores every key as a string
  and gives back the key types of the target it restores into.
  """

  def value(leaf):
    leaf = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    return key_data(leaf) if _is_key(leaf) else leaf

  return nnx.to_pure_dict(state, value)


def _abstract_savable(abstract_state: nnx.State) -> dict:
  return _savable(abstract_state, functools.partial(jax.eval_shape, jax.random.key_data))


def _from_savable(abstract_state: nnx.State, restored: dict) -> nnx.State:
  def fill(variable, value):
    current = variable.get_value() if isinstance(variable, nnx.Variable) else variable
    if _is_key(current):  # Back with JAX's default PRNG implementation, as nnx.Rngs uses.
      value = jax.random.wrap_key_data(value)
    return variable.replace(value) if hasattr(variable, "replace") else value

  state = jax.tree.map(lambda x: x, abstract_state)  # A copy to fill in.
  nnx.replace_by_pure_dict(state, restored, fill)
  return state


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: nnx.State,
    data_iterator: Any,
    metadata: dict,
    *,
    force: bool = False,
) -> bool:
  """Saves state, data position and metadata as one step; True if it saved.

  Without `force`, saves when Orbax's default policy says so: on multiples of
  `save_every`, and the first save into an empty directory. Returns when the
  step is on disk, except inside `with manager:` or `manager.async_saves()`
  (and `async_save` on): then it returns once the arrays are copied to host
  memory (so the caller may donate or overwrite them) and a background thread
  writes them; the next `save`, `restore`, `close()` and the block's end wait
  for it, and a failed background write raises from that wait. A read-only
  manager saves nothing (Orbax's own check skips only unforced saves).
  """
  if getattr(manager, "read_only", False):
    return False
  saved = manager.save(
      step,
      args=ocp.args.Composite(
          state=ocp.args.StandardSave(_savable(state)),
          data=grain.checkpoint.CheckpointSave(data_iterator),
          meta=ocp.args.JsonSave(metadata),
      ),
      force=force,
  )
  if saved:  # Orbax waited for the previous save, whose deletions are now in the trash.
    _empty_trash(manager.directory)
    if isinstance(manager, Manager) and not manager.saves_in_background:
      manager.wait_until_finished()  # Nothing could finish it once the script has ended.
  return saved


def _mismatches(stored: Any, target: dict, *, subset: bool = False) -> list[str]:
  """What differs between the checkpoint's tree and `target`'s (`subset`: only the parts of
  the checkpoint that target reads from, e.g. a base run's model and not its optimizer: a
  base with more layers than the config does not fit either)."""
  stored, expected = _shapes_by_path(stored), _shapes_by_path(target)
  if subset:
    roots = {path.split("/")[0] for path in expected}
    stored = {path: shape for path, shape in stored.items() if path.split("/")[0] in roots}
  problems = []
  for path in sorted(expected.keys() | stored.keys()):
    want, have = expected.get(path), stored.get(path)
    if have is None:
      problems.append(f"{path}: not in the checkpoint (config expects shape {want})")
    elif want is None:
      problems.append(f"{path}: in the checkpoint (shape {have}) but not in the config")
    elif have != want:
      problems.append(f"{path}: checkpoint shape {have}, config shape {want}")
  return problems


def _raise_if_unfit(manager, step: int, problems: list[str], what: str | None = None) -> None:
  if not problems:
    return
  shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
  if what is not None:
    raise CheckpointMismatchError(f"{what} (step {step} in {manager.directory}) does not fit "
                                  f"this config: {shown}")
  raise CheckpointMismatchError(
      f"the checkpoint at step {step} in {manager.directory} does not fit this config: {shown}. "
      "Use the config it was trained with, or a new --workdir (nothing was changed)."
  )


def _read_target(manager, step: int, abstract_state: nnx.State, *, subset: bool = False,
                 what: str | None = None) -> tuple[dict, str | None]:
  """What to read `step` into: the savable tree of `abstract_state`, or, if the step
  holds the other layer layout of the same model, that tree in the step's layout.

  Returns the target and a line saying what the conversion after reading will be
  (None: none). Raises `CheckpointMismatchError` (naming the differences from
  `abstract_state` itself) when neither fits.
  """
  manager.wait_until_finished()
  stored = manager.item_metadata(step)["state"]
  if stored is None:  # What Orbax gives for a state item without its _METADATA file.
    raise _Damaged("no tree metadata (_METADATA)")
  target = _abstract_savable(abstract_state)
  problems = _mismatches(stored, target, subset=subset)
  if not problems:
    return target, None
  try:
    saved_layout, scanned = layer_stack.match_layout(target, _nested(stored))
  except (ValueError, TypeError, KeyError):  # Blocks that do not stack: not one model's layouts.
    saved_layout, scanned = target, None
  if scanned is None or _mismatches(stored, saved_layout, subset=subset):
    _raise_if_unfit(manager, step, problems, what)
  wanted = layer_stack.layout_name(not scanned)
  note = (f"checkpoint step {step} has the {layer_stack.layout_name(scanned)} layout; converted "
          f"to {wanted} (model.scan_layers={str(not scanned).lower()})")
  return saved_layout, note


def _nested(tree: Any) -> dict:
  """A checkpoint's metadata tree as nested dicts with string keys (leaves: None)."""
  return traverse_util.unflatten_dict({
      jax.tree_util.keystr(path, simple=True, separator="/"): None
      for path, _ in jax.tree_util.tree_leaves_with_path(tree)
  }, sep="/")


def _to_target_layout(items: dict, abstract_state: nnx.State) -> dict:
  """A step read in its own layer layout, moved into `abstract_state`'s (and its shardings).

  Parameter by parameter, freeing what was read (`match_layout(consume=True)`):
  a whole state copied at once would need twice its memory. Only copies (stacking,
  indexing): the bits stay the saved ones. `items` is unusable afterwards.
  """
  target = _abstract_savable(abstract_state)
  converted, _ = layer_stack.match_layout(items, target, consume=True)
  return jax.tree.map(layer_stack.place, converted, target)


def _shapes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
  """{'layers/0/kernel': shape}: integer and string keys name a path alike."""
  return {
      jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


class _Damaged(Exception):
  """A step file found missing or malformed by this package's own checks."""


def tree_equal(a: Any, b: Any) -> bool:
  """Bitwise equality of two pytrees of arrays (PRNG keys compared by key data)."""
  unwrap = lambda x: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(unwrap(x), unwrap(y)) and unwrap(x).dtype == unwrap(y).dtype
      for x, y in zip(la, lb)
  )


def read_leaves(state_dir: pathlib.Path, target: dict) -> dict:
  """Orbax's tree of `target`'s leaves alone, read from a step's state directory (the
  manager's restore reads a whole item: a partial target is refused)."""
  args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  with ocp.PyTreeCheckpointer() as reader:
    return reader.restore(state_dir, args=args)


def restore_subset(manager: ocp.CheckpointManager, step: int, abstract_state: nnx.State,
                   *, what: str = "the checkpoint") -> nnx.State:
  """Reads only the leaves of `abstract_state` from `step`'s state (the rest stays on disk).

  What a fine-tuning run reads of its base: the model's parameters, not the
  optimizer moments beside them. Shapes are checked first: a leaf missing or
  of another shape raises `CheckpointMismatchError` naming `what`, and nothing
  is read. A base saved with the other layer layout (`model.scan_layers`) is
  read as saved and converted.
  """
  target, note = _read_target(manager, step, abstract_state, subset=True, what=what)
  items = read_leaves(pathlib.Path(manager.directory) / str(step) / "state", target)
  if note is not None:
    items = _to_target_layout(items, abstract_state)
    log.info("%s (%s)", note, what)
  return _from_savable(abstract_state, items)
