"""Orbax checkpointing of a whole training job as ONE atomic step.

A step directory holds three items written together: `state` (model parameters,
optimizer state, RNG state: everything `nnx.split` returns), `data` (the Grain
iterator position) and `meta` (the step, the resolved config, the kernel choice,
as JSON). Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it
when complete, so a process killed mid-save never leaves a half step that
`latest_step()` would return; `cleanup_tmp_directories` removes such leftovers.

Restoring checks shapes before reading (a config that does not fit the
checkpoint names the parameter and both shapes, and touches nothing), and falls
back past a corrupt newest step to the previous good one, moving the corrupt
directory aside rather than deleting anything.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jax_ai_stack.errors import CheckpointMismatchError
from jax_ai_stack.recipes import pytree
from jax_ai_stack.recipes.configlib import config_dataclass

log = logging.getLogger(__name__)


@config_dataclass
class CheckpointConfig:
  save_every: int = 100
  """Save every this many steps (and always at the end or on SIGTERM/SIGINT)."""
  keep_last: int = 3
  """Keep this many most recent steps."""
  keep_every: int | None = None
  """Also keep every step divisible by this, forever (None: only the last ones)."""
  async_save: bool = True
  """Write in a background thread; training blocks only while arrays are copied."""

  def __post_init__(self):
    if self.save_every < 1:
      raise ValueError(f"checkpoint.save_every must be >= 1, got {self.save_every}")
    if self.keep_last < 1:
      raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
    if self.keep_every is not None and self.keep_every < 1:
      raise ValueError(f"checkpoint.keep_every must be >= 1 or null, got {self.keep_every}")


@dataclasses.dataclass
class Restored:
  step: int
  state: nnx.State
  metadata: dict


def build_manager(directory: str | pathlib.Path, config: CheckpointConfig) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=config.save_every,
      max_to_keep=config.keep_last,
      keep_period=config.keep_every,
      enable_async_checkpointing=config.async_save,
      cleanup_tmp_directories=True,
      create=True,
  )
  return ocp.CheckpointManager(
      pathlib.Path(directory).absolute(),
      options=options,
      item_handlers={
          "state": ocp.StandardCheckpointHandler(),
          "data": grain.checkpoint.CheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler(),
      },
  )


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(state: nnx.State) -> dict:
  """Pure nested dict of arrays; typed PRNG keys become their raw key data."""
  pure = nnx.to_pure_dict(state)
  return pytree.stringify_keys(
      jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, pure)
  )


def _abstract_savable(abstract_state: nnx.State) -> dict:
  pure = nnx.to_pure_dict(abstract_state)
  return pytree.stringify_keys(
      jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, pure)
  )


def _from_savable(abstract_state: nnx.State, restored: dict) -> nnx.State:
  abstract = nnx.to_pure_dict(abstract_state)
  rewrapped = jax.tree.map(
      # Keys come back with JAX's default PRNG implementation, the one nnx.Rngs uses.
      lambda a, x: jax.random.wrap_key_data(x) if _is_key(a) else x,
      abstract,
      pytree.rekey_like(abstract, restored),
  )
  state = jax.tree.map(lambda x: x, abstract_state)  # A copy to fill in.
  nnx.replace_by_pure_dict(state, rewrapped)
  return state


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: nnx.State,
    data_iterator: Any,
    metadata: dict,
    *,
    force: bool = False,
) -> bool:
  """Saves state, data position and metadata as one step; True if it saved."""
  return manager.save(
      step,
      args=ocp.args.Composite(
          state=ocp.args.StandardSave(_to_savable(state)),
          data=grain.checkpoint.CheckpointSave(data_iterator),
          meta=ocp.args.JsonSave(metadata),
      ),
      force=force,
  )


def read_metadata(manager: ocp.CheckpointManager, step: int | None = None) -> dict:
  """The JSON metadata (config, step, ...) of a step, without reading arrays."""
  step = manager.latest_step() if step is None else step
  restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  return restored["meta"]


def check_fits(manager: ocp.CheckpointManager, step: int, abstract_state: nnx.State) -> None:
  """Raises `CheckpointMismatchError` naming every parameter whose shape differs."""
  stored = manager.item_metadata(step)["state"]
  expected = _abstract_savable(abstract_state)
  stored_flat = {pytree.path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(stored)}
  expected_flat = {pytree.path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(expected)}
  problems = []
  for path in sorted(expected_flat.keys() | stored_flat.keys()):
    want, have = expected_flat.get(path), stored_flat.get(path)
    if have is None:
      problems.append(f"{path}: not in the checkpoint (config expects shape {tuple(want.shape)})")
    elif want is None:
      problems.append(f"{path}: in the checkpoint (shape {tuple(have.shape)}) but not in the config")
    elif tuple(have.shape) != tuple(want.shape):
      problems.append(f"{path}: checkpoint shape {tuple(have.shape)}, config shape {tuple(want.shape)}")
  if problems:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    raise CheckpointMismatchError(
        f"the checkpoint at step {step} in {manager.directory} does not fit this config: {shown}. "
        "Use the config it was trained with, or a new --workdir (nothing was changed)."
    )


def _quarantine(manager: ocp.CheckpointManager, step: int) -> pathlib.Path:
  """Moves a corrupt step aside (never deletes) so the step number can be saved again."""
  source = pathlib.Path(manager.directory) / str(step)
  target = source.with_name(f"{step}.corrupt")
  index = 1
  while target.exists():
    target = source.with_name(f"{step}.corrupt{index}")
    index += 1
  source.rename(target)
  manager.reload()
  return target


def restore(
    manager: ocp.CheckpointManager, abstract_state: nnx.State, data_iterator: Any
) -> Restored | None:
  """Restores the newest good step into `abstract_state` and `data_iterator`.

  Returns None when the directory has no checkpoint. A newest step that fails to
  read is moved aside as `<step>.corrupt` with a warning, and the previous step
  is tried; a shape mismatch is not corruption and raises at once.
  """
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      check_fits(manager, step, abstract_state)
      restored = manager.restore(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardRestore(_abstract_savable(abstract_state)),
              data=grain.checkpoint.CheckpointRestore(data_iterator),
              meta=ocp.args.JsonRestore(),
          ),
      )
    except CheckpointMismatchError:
      raise
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable.
      moved = _quarantine(manager, step)
      log.warning("checkpoint step %d is unreadable (%s: %s); moved it to %s and trying the previous one",
                  step, type(e).__name__, e, moved)
      continue
    return Restored(step, _from_savable(abstract_state, restored["state"]), restored["meta"])
  return None


def tree_equal(a: Any, b: Any) -> bool:
  """Bitwise equality of two pytrees of arrays (PRNG keys compared by key data)."""
  unwrap = lambda x: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(unwrap(x), unwrap(y)) and unwrap(x).dtype == unwrap(y).dtype
      for x, y in zip(la, lb)
  )
