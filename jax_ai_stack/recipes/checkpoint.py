"""Orbax checkpointing of a whole training job as ONE atomic step.

A step directory holds three items written together: `state` (model parameters,
optimizer state, RNG state: everything `nnx.split` returns), `data` (the Grain
iterator position) and `meta` (the step, the resolved config, the kernel choice,
as JSON). Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it
when complete, so a process killed mid-save never leaves a half step that
`latest_step()` would return; opening a manager removes such leftovers.

Saves can run in the background (`CheckpointConfig.async_save`), but only
inside a block that waits for them at its end: `with manager:` (which closes
the manager) or `with manager.async_saves():` (what the trainer's loop uses).
There `save` returns once the arrays are copied to host memory and a thread
writes them. Anywhere else `save` returns when the step is on disk, so a
script that ends right after `save` never loses it: from Python 3.12 on, no
thread can start once the main script has ended, and Orbax needs new threads to
finish a step. `restore` and `read_metadata` wait for a save in flight.

Old steps (beyond `keep_last`, except multiples of `keep_every`) are deleted
only after the new step is complete, in two moves that a kill cannot split:
Orbax renames the step into `<checkpoint dir>/todelete/` and this module then
removes it. Opening a manager finishes both, and applies the retention rule to
what is on disk (a run killed right after its last save has one step too many).

Restoring checks shapes before reading (a config that does not fit the
checkpoint names the parameter and both shapes, and touches nothing), converts
a step saved with the other Llama layer layout (`model.scan_layers` flipped:
`layers/N/...` vs stacked `layers/...`, parameters and optimizer moments alike;
see `models.layer_stack`) after reading it as saved, and falls
back past a corrupt newest step to the previous good one, moving the corrupt
directory aside as `<step>.corrupt` rather than deleting anything. It prints one
short warning line per corrupt step; the full error, and everything the
libraries printed meanwhile, goes to `checkpoint-errors.log` beside the
checkpoint directory (in the workdir). Only a damaged file counts as corruption
(`corruption` says which errors): out of memory, an I/O error or a bug raises
as it is and moves nothing, and when no step reads, `WorkdirError` names each
step and why, and nothing is moved either (a run never starts over at step 0).

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

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import grain
import jax
import msgpack
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from jax_ai_stack.errors import CheckpointMismatchError, WorkdirError
from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig
from jax_ai_stack.recipes.models import layer_stack

log = logging.getLogger(__name__)

TRASH_DIR = "todelete"
"""Orbax's `todelete_subdir`: old steps are renamed into it, then removed."""
ERROR_LOG = "checkpoint-errors.log"
"""Beside the checkpoint directory: the full detail of each unreadable step."""
_CORRUPT = ".corrupt"


@dataclasses.dataclass
class Restored:
  step: int
  state: nnx.State
  metadata: dict
  converted: str | None = None
  """What was converted on the way in (a step of the other layer layout), else None."""


# ---- the manager --------------------------------------------------------------


class Manager(ocp.CheckpointManager):
  """An Orbax `CheckpointManager` that cannot lose a save at exit.

  Built by `build_manager`. Saves run in the background only inside
  `with manager:` or `with manager.async_saves():`, whose end waits for them.
  The manager is closed when the interpreter exits if nobody closed it (that
  releases Orbax's threads; it cannot finish a save on Python 3.12+, hence the
  blocks); `close()` may be called more than once.
  """

  read_only: bool = False
  async_save: bool = False
  """`CheckpointConfig.async_save` of a writable manager."""
  _closed: bool = False
  _async_blocks: int = 0

  @property
  def saves_in_background(self) -> bool:
    """Whether `save` returns before the step is on disk (inside a block, `async_save` on)."""
    return self._async_blocks > 0 and self.async_save

  @contextlib.contextmanager
  def async_saves(self):
    """Within: `save` writes in the background. Leaving waits until the steps are on disk."""
    self._async_blocks += 1
    try:
      yield self
    finally:
      self._async_blocks -= 1
      self.wait_until_finished()

  def __contextmanager__(self):
    """`with manager:` saves in the background, then waits and closes."""
    try:
      with self.async_saves():
        yield self
    finally:
      self.close()

  def close(self) -> None:
    """Waits for a save in flight, then releases Orbax's threads and files."""
    if self._closed:
      return
    self._closed = True
    _OPEN_MANAGERS.discard(self)
    try:
      # Orbax 0.12.8 starts removing leftover tmp dirs in a thread when the
      # manager opens and awaits it only in save(); a manager closed without
      # saving would leave that thread to die at interpreter exit, printing
      # "cannot schedule new futures after interpreter shutdown".
      self._maybe_await_cleanup_tmp_directory()
      super().close()
    finally:
      if not self.read_only:
        _empty_trash(self.directory, remove_dir=True)


_OPEN_MANAGERS: weakref.WeakSet[Manager] = weakref.WeakSet()


def _close_open_managers() -> None:
  for manager in list(_OPEN_MANAGERS):
    try:
      manager.close()
    except Exception as e:  # noqa: BLE001 - at exit, report and go on to the next manager.
      log.error("a checkpoint save in %s failed: %s: %s", manager.directory, type(e).__name__, e)


@functools.cache
def _close_managers_at_exit() -> None:
  """Registers `_close_open_managers` to run when the main thread ends.

  Closing releases Orbax's threads (its tmp-directory cleanup among them). A
  plain `atexit` hook runs too late: the interpreter first runs threading's
  exit hooks, where `concurrent.futures` stops accepting work, and those
  threads would fail ("cannot schedule new futures after interpreter
  shutdown"). `threading._register_atexit` (what `concurrent.futures` itself
  uses) runs hooks in reverse order of registration, so this one runs first.
  """
  register = getattr(threading, "_register_atexit", None)
  if register is None:  # Not CPython: the best a public API offers.
    import atexit

    atexit.register(_close_open_managers)
  else:
    register(_close_open_managers)


def build_manager(
    directory: str | pathlib.Path, config: CheckpointConfig, *, read_only: bool = False
) -> Manager:
  """A checkpoint manager for `directory`, saving the items `save` writes.

  Inside `with manager:` (closes it at the end) or `with
  manager.async_saves():`, and unless `config.async_save` is False, `save`
  returns while a background thread writes the step; `manager.latest_step()`
  already counts that step (Orbax's view) although it is only on disk as
  `<step>.orbax-checkpoint-tmp` until the thread finishes. `restore` and
  `read_metadata` wait for it, and so does the end of the block. Outside such a
  block `save` returns when the step is on disk. Close the manager when done;
  if you do not, it is closed when the interpreter exits.

  Opening a writable manager creates `directory`, removes the leftovers of
  killed saves and deletions, and deletes the steps that `keep_last` and
  `keep_every` do not keep.

  Args:
    directory: the checkpoint directory (`<workdir>/checkpoints`).
    config: when to save and which steps to keep (ignored when read-only).
    read_only: for reading an archived run (`eval`, `generate`), possibly on a
      read-only disk: nothing is created, cleaned up, moved or written, and
      `save` does nothing. A corrupt step is then skipped, not moved aside.
  """
  directory = pathlib.Path(directory).absolute()
  with _without_absl_warning("Given directory is read only"):  # Orbax says so at every open.
    manager = Manager(directory, options=_options(config, read_only), item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    })
  manager.read_only = read_only
  manager.async_save = config.async_save and not read_only
  if not read_only:
    _OPEN_MANAGERS.add(manager)
    _close_managers_at_exit()
    try:
      _empty_trash(manager.directory)  # First: Orbax cannot rename a step onto a leftover.
      _apply_retention(manager, _preservation_policy(config))
      _empty_trash(manager.directory, remove_dir=True)
    except BaseException:
      manager.close()
      raise
  return manager


def _options(config: CheckpointConfig, read_only: bool) -> ocp.CheckpointManagerOptions:
  if read_only:
    # Orbax would force these itself for read_only=True, logging a warning for each.
    return ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, enable_async_checkpointing=False
    )
  return ocp.CheckpointManagerOptions(
      save_interval_steps=config.save_every,
      preservation_policy=_preservation_policy(config),
      enable_async_checkpointing=config.async_save,
      cleanup_tmp_directories=True,  # Killed saves: <step>.orbax-checkpoint-tmp.
      todelete_subdir=TRASH_DIR,  # Delete by rename: a kill never leaves half a step.
      create=True,
  )


@contextlib.contextmanager
def _without_absl_warning(prefix: str):
  """Drops absl log records whose message starts with `prefix`, meanwhile."""
  absl_logger = logging.getLogger("absl")
  drop = lambda record: not str(record.msg).startswith(prefix)  # noqa: E731
  absl_logger.addFilter(drop)
  try:
    yield
  finally:
    absl_logger.removeFilter(drop)


def _preservation_policy(config: CheckpointConfig) -> policies.PreservationPolicy:
  """keep_last latest steps, plus every multiple of keep_every."""
  kept = [policies.LatestN(n=config.keep_last)]
  if config.keep_every is not None:
    kept.append(policies.EveryNSteps(interval_steps=config.keep_every))
  return policies.AnyPreservationPolicy(kept)


@dataclasses.dataclass
class _StepInfo:
  """What Orbax's preservation policies read of a step (`PolicyCheckpointInfo`)."""

  step: int
  time: datetime.datetime
  metrics: dict | None = None


def _apply_retention(manager: Manager, policy: policies.PreservationPolicy) -> None:
  """Deletes the steps on disk that `policy` does not keep.

  Orbax applies the policy only after a save, so a run killed after its last
  save (before the deletion) would otherwise keep one step too many for good.
  """
  now = datetime.datetime.now(datetime.timezone.utc)
  infos = [_StepInfo(step, now) for step in sorted(manager.all_steps())]
  keep = policy.should_preserve(infos, context=policies.PreservationContext())
  for info, kept in zip(infos, keep):
    if not kept:
      log.info("deleting checkpoint step %d of %s (retention policy)", info.step, manager.directory)
      manager.delete(info.step)


def _empty_trash(directory: os.PathLike, *, remove_dir: bool = False) -> None:
  """Removes the steps Orbax renamed into TRASH_DIR (also half-removed ones).

  Safe while Orbax renames another step in (each entry is removed on its own);
  `remove_dir` also removes the empty directory, for when no save is in flight.
  """
  trash = pathlib.Path(directory) / TRASH_DIR
  if not trash.is_dir():
    return
  for entry in trash.iterdir():
    if entry.is_dir() and not entry.is_symlink():
      shutil.rmtree(entry, ignore_errors=True)
    else:
      entry.unlink(missing_ok=True)
  if remove_dir:
    with contextlib.suppress(OSError):
      trash.rmdir()


# ---- saving -------------------------------------------------------------------


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


# ---- reading ------------------------------------------------------------------


def read_metadata(manager: ocp.CheckpointManager, step: int | None = None) -> dict:
  """The JSON metadata (config, step, ...) of `step`, without arrays.

  `step` None: the newest step whose metadata reads. Steps whose metadata file
  is damaged are passed over without a word (and never moved): the `restore`
  that follows says so, once. Raises `WorkdirError` when no step's metadata
  reads; any other failure (out of memory, an I/O error) raises as it is.
  """
  if step is not None:
    manager.wait_until_finished()
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  found = newest_readable(manager, functools.partial(_read_meta, manager), quiet=True)
  if found is None:
    raise WorkdirError(f"no checkpoint in {manager.directory}")
  return found[1]


def check_fits(manager: ocp.CheckpointManager, step: int, abstract_state: nnx.State) -> None:
  """Raises `CheckpointMismatchError` naming every parameter whose shape differs."""
  manager.wait_until_finished()
  stored = manager.item_metadata(step)["state"]
  _raise_if_unfit(manager, step, _mismatches(stored, _abstract_savable(abstract_state)))


def _mismatches(stored: Any, target: dict, *, subset: bool = False) -> list[str]:
  """What differs between the checkpoint's tree and `target`'s (`subset`: target's leaves only)."""
  stored, expected = _shapes_by_path(stored), _shapes_by_path(target)
  problems = []
  for path in sorted(expected.keys() if subset else expected.keys() | stored.keys()):
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
  out: dict = {}
  for path, _ in jax.tree_util.tree_leaves_with_path(tree):
    keys = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = None
  return out


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


# ---- corrupt steps --------------------------------------------------------------

_DAMAGE_BY_STATUS = {
    "DATA_LOSS": "damaged data",
    "OUT_OF_RANGE": "truncated",
    "NOT_FOUND": "missing",
}
"""TensorStore status codes (the prefix of its ValueError's message) of a bad file.

TensorStore 0.1.86 raises ValueError for every status but UNIMPLEMENTED and
drops only the INVALID_ARGUMENT prefix. A local file's OS error (EIO, EAGAIN,
...) is FAILED_PRECONDITION with `[OS error` in the message, ENOSPC and ENOMEM
RESOURCE_EXHAUSTED, EACCES PERMISSION_DENIED: none of those is the content.
"""
_STATUS = re.compile(r"([A-Z][A-Z_]+): ")


class _Damaged(Exception):
  """A step file found missing or malformed by this module's own checks."""


class _StepUnreadable(Exception):
  """Internal: `step`'s files are damaged; `reason` says which and how."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def corruption(error: BaseException) -> str | None:
  """What `error` says is wrong with a checkpoint file's content, or None.

  None means the error is not about what is on disk (out of memory, an I/O or
  permission error, a bug): reading an older step would not help, and moving
  this one aside would lose a good step. The types are those Orbax 0.12.8,
  TensorStore 0.1.86, Grain 0.2.18 and json/msgpack raise for a truncated,
  garbled or missing file of a finished step.

  Example:
    >>> corruption(json.JSONDecodeError("Expecting value", "garbage", 0))
    'not valid JSON'
    >>> corruption(ValueError("DATA_LOSS: Error reading local file")), corruption(MemoryError())
    ('damaged data', None)
  """
  if isinstance(error, BaseExceptionGroup):  # Items read concurrently: all of them damaged.
    reasons = [corruption(e) for e in error.exceptions]
    return reasons[0] if reasons and all(reasons) else None
  if isinstance(error, _Damaged):
    return str(error)
  if isinstance(error, FileNotFoundError):  # Orbax's "File ... not found." (errno None).
    return "missing"
  if isinstance(error, json.JSONDecodeError):
    return "not valid JSON"
  if isinstance(error, UnicodeDecodeError):
    return "not valid UTF-8 text"
  if isinstance(error, (msgpack.exceptions.UnpackException, msgpack.exceptions.ExtraData)):
    return "not valid msgpack"  # Orbax's aggregate file, in steps older Orbax versions wrote.
  if type(error) is not ValueError:  # TensorStore and Grain raise plain ValueErrors.
    return None
  text = str(error)
  if re.fullmatch(r"File \S+ does not exist\.", text):  # Grain's iterator state file.
    return "missing"
  match = _STATUS.match(text)
  status = match.group(1) if match else None
  if status in _DAMAGE_BY_STATUS:
    return _DAMAGE_BY_STATUS[status]
  if status == "FAILED_PRECONDITION" and "[OS error" not in text:
    return "not valid JSON" if "Invalid JSON" in text else "malformed"
  if status is None and "Error reading" in text and "tensorstore_spec" in text:
    return "damaged data"  # INVALID_ARGUMENT (prefix dropped): e.g. "Data corruption detected".
  return None


@contextlib.contextmanager
def _reading(step_dir: pathlib.Path, item: str):
  """Turns a damaged file of `item` into `_StepUnreadable` naming it; anything else passes."""
  try:
    yield
  except Exception as e:
    reason = corruption(e)
    if reason is None:
      raise
    raise _StepUnreadable(f"{_damaged_file(e, step_dir, item)}: {reason}") from e


def _damaged_file(error: BaseException, step_dir: pathlib.Path, item: str) -> str:
  """The path inside the step that `error` names (`state/_sharding`), else the item's."""
  match = re.search(re.escape(str(step_dir)) + r"/([^\"':\s]+)", str(error))
  if match and match.group(1).strip("/"):
    return match.group(1).strip("/")
  return "meta/metadata" if item == "meta" else item


def _read_meta(manager, step: int) -> dict:
  step_dir = pathlib.Path(manager.directory) / str(step)
  _check_items(step_dir, ["meta"])
  with _reading(step_dir, "meta"):
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _check_items(step_dir: pathlib.Path, items: list[str]) -> None:
  if not step_dir.is_dir():  # Orbax counts a save in flight, still <step>.orbax-checkpoint-tmp.
    raise _StepUnreadable("not on disk yet")
  for item in items:
    if not (step_dir / item).is_dir():
      raise _StepUnreadable(f"{item}: missing")


@dataclasses.dataclass
class _Unreadable:
  """A step that failed to read; the error as text, so no traceback keeps Orbax's tasks alive."""

  step: int
  reason: str
  """What is damaged, for the warning: `meta/metadata: not valid JSON`."""
  summary: str
  """The error's type and first line, for the log."""
  detail: str
  """The traceback, for the error log."""
  moved_to: pathlib.Path | None = None


_T = TypeVar("_T")


def newest_readable(manager: ocp.CheckpointManager, read: Callable[[int], _T], *,
                    quiet: bool = False) -> tuple[int, _T] | None:
  """(step, `read(step)`) for the newest step whose files read; None when there is no step.

  The one recovery path of every command that reads a run. `read` wraps its
  reads of each item in `_reading`, so a damaged file raises `_StepUnreadable`;
  that step is passed over and the previous one tried. Once a step reads, each
  newer one is moved aside as `<step>.corrupt` (unless the manager is
  read-only) and gets one warning line; the full errors, with everything the
  libraries printed, go to `checkpoint-errors.log`. Nothing is moved before a
  step reads: when none does, `WorkdirError` names each step and why. Any
  other error (out of memory, I/O, a config that does not fit) raises at once
  and moves nothing. `quiet`: skip damaged steps without a word or a move.
  """
  manager.wait_until_finished()  # Until then the newest step is only <step>.orbax-checkpoint-tmp.
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    return None
  unreadable: list[_Unreadable] = []
  found = output = None
  try:
    with _stderr_captured() as output:
      try:
        found = _first_readable(steps, read, unreadable)
      finally:
        if unreadable:
          output.wait_until_quiet()
  except BaseException:
    _keep_output(manager, unreadable, output, quiet)
    raise
  read_only = getattr(manager, "read_only", False)
  if found is not None and unreadable and not read_only and not quiet:
    for item in unreadable:
      item.moved_to = _move_aside(manager, item.step)
    manager.reload()  # Forget the steps moved aside.
  log_path = _keep_output(manager, unreadable, output, quiet)
  if found is None:
    listed = "; ".join(f"step {item.step}: {item.reason}" for item in unreadable)
    details = f"; details in {log_path}" if log_path else ""
    start_over = "" if read_only else f"; to start over, move {manager.directory} aside"
    raise WorkdirError(f"no checkpoint step in {manager.directory} is readable ({listed}); "
                       f"nothing was moved{details}{start_over}")
  if not quiet:
    for item in unreadable:
      done = (f"moved aside to {item.moved_to.name}, resuming from" if item.moved_to else
              "skipped, using" if read_only else "left in place, resuming from")
      line = f"checkpoint step {item.step} is unreadable ({item.reason}); {done} step {found[0]}"
      # Printed, not logged: a handler that absl's `logging.basicConfig()` added would prefix it.
      print(f"warning: {line}", file=sys.stderr, flush=True)
      log.info("%s; %s; details in %s", line, item.summary, log_path or "no error log")
  return found


def _first_readable(steps: list[int], read, unreadable: list[_Unreadable]):
  for step in steps:
    try:
      return step, read(step)
    except _StepUnreadable as e:
      cause = e.__cause__ or e
      unreadable.append(_Unreadable(step, e.reason, _first_line(cause),
                                    "".join(traceback.format_exception(cause))))
  return None


def _keep_output(manager, unreadable: list[_Unreadable], output, quiet: bool) -> pathlib.Path | None:
  """The error log with what was captured, if a step was unreadable; else the output echoed."""
  text = output.text if output is not None else ""
  if unreadable and not quiet:
    return _write_error_log(manager, unreadable, text)
  if text and not unreadable:
    sys.stderr.write(text)  # Nothing was unreadable: show what the libraries said.
  return None


def restore(
    manager: ocp.CheckpointManager, abstract_state: nnx.State, data_iterator: Any = None
) -> Restored | None:
  """Restores the newest good step into `abstract_state` (and `data_iterator`).

  Waits for a save in flight first. Returns None when the directory has no
  step. `data_iterator` None restores the state and metadata only (a
  read-only look at a run). A step whose files are damaged is passed over for
  the previous one and, once one reads, moved aside as `<step>.corrupt` (left
  in place when the manager is read-only), with one warning line each (see
  `newest_readable`; the error log is in the checkpoint directory's parent, the
  system temp directory when read-only). Raises `WorkdirError` naming each step
  when none reads, and `CheckpointMismatchError` at once when the config does
  not fit: neither moves anything, nor does any other error.

  `abstract_state` is the state's shapes and dtypes without any arrays (so
  nothing is initialised just to be overwritten): the state of a model and
  optimizer built under `nnx.eval_shape`, e.g.
  `nnx.state(nnx.eval_shape(lambda: (model_fn(), optimizer_fn())))`. Leaves
  that carry a `sharding` are restored onto it.
  """
  found = newest_readable(manager, functools.partial(
      _read_step, manager, abstract_state=abstract_state, data_iterator=data_iterator))
  if found is None:
    return None
  step, (metadata, state, note) = found
  if note is not None:  # Outside the loop: a failure here is no corruption of the step.
    state = _to_target_layout(state, abstract_state)
    log.info("%s", note)
  return Restored(step, _from_savable(abstract_state, state), metadata, note)


def _read_step(manager, step: int, *, abstract_state, data_iterator):
  """(metadata, Orbax's state tree, layout note) of `step`, item by item to name a damaged one.

  Each step is read in its own layer layout (steps of one workdir may differ).
  The data position is read last, so a step whose state is damaged leaves
  `data_iterator` alone.
  """
  step_dir = pathlib.Path(manager.directory) / str(step)
  _check_items(step_dir, ["meta", "state"] + (["data"] if data_iterator is not None else []))
  metadata = _read_meta(manager, step)
  with _reading(step_dir, "state"):
    target, note = _read_target(manager, step, abstract_state)
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
  if data_iterator is not None:
    with _reading(step_dir, "data"):
      manager.restore(step, args=ocp.args.Composite(
          data=grain.checkpoint.CheckpointRestore(data_iterator)))
  return metadata, state, note


def _move_aside(manager: ocp.CheckpointManager, step: int) -> pathlib.Path | None:
  """Renames a corrupt step to `<step>.corrupt` (never deletes), freeing its number.

  Only a finished step directory is moved; a save in flight (its temporary
  directory) is never touched.
  """
  source = pathlib.Path(manager.directory) / str(step)
  if not source.is_dir():
    return None
  target = source.with_name(f"{step}{_CORRUPT}")
  index = 1
  while target.exists():
    target = source.with_name(f"{step}{_CORRUPT}{index}")
    index += 1
  try:
    source.rename(target)
  except FileNotFoundError:  # Another process of a multi-host job moved it first.
    return None
  return target


def _first_line(error: Exception) -> str:
  """`Type: message`, cut at TensorStore's spec dump and at 200 characters."""
  lines = str(error).strip().splitlines()
  text = lines[0].split(" [tensorstore_spec=")[0] if lines else ""
  return f"{type(error).__name__}: {text[:200] + '...' if len(text) > 200 else text}"


def _error_log_path(manager: ocp.CheckpointManager) -> pathlib.Path:
  if getattr(manager, "read_only", False):
    return pathlib.Path(tempfile.gettempdir()) / f"jax-ai-stack-{ERROR_LOG}"
  return pathlib.Path(manager.directory).parent / ERROR_LOG


def _write_error_log(manager, unreadable: list[_Unreadable], output: str) -> pathlib.Path | None:
  """Appends the tracebacks and the captured output; returns the log, None if it failed."""
  path = _error_log_path(manager)
  now = datetime.datetime.now().isoformat(timespec="seconds")
  parts = [f"=== {now}: restoring from {manager.directory}\n"]
  for item in unreadable:
    where = f"moved to {item.moved_to}" if item.moved_to else "left in place"
    parts.append(f"--- step {item.step} is unreadable ({item.reason}; {where}):\n")
    parts.append(item.detail)
  if output:
    parts += ["--- printed while restoring:\n", output]
  try:
    with open(path, "a", encoding="utf-8") as f:
      f.write("".join(parts) + "\n")
  except OSError:
    return None
  return path


class _Captured:
  """Output captured into the file `fd`; `text` once the capture has ended."""

  def __init__(self, fd: int):
    self.fd = fd
    self.text = ""

  def wait_until_quiet(self, quiet_s: float = 0.2, limit_s: float = 2.0) -> None:
    """Keeps capturing until nothing new was written for `quiet_s` seconds.

    After a failed read, TensorStore's threads go on completing the reads Orbax
    abandoned, each printing a traceback, and asyncio reports its abandoned
    tasks when they are collected: a few milliseconds, after the error.
    """
    deadline = time.monotonic() + limit_s
    size = -1
    while time.monotonic() < deadline:
      gc.collect()
      current = os.fstat(self.fd).st_size
      if current == size:
        return
      size = current
      time.sleep(quiet_s)


@contextlib.contextmanager
def _stderr_captured():
  """Everything written to file descriptor 2 meanwhile, as `.text` afterwards.

  A corrupt step makes Orbax, absl, asyncio and TensorStore's threads print
  thousands of lines (specs; one "Event loop is closed" traceback per pending
  read, through `sys.unraisablehook`); only the file descriptor catches them
  all. The hook is redirected too, in case something (pytest) replaced it.
  """
  with tempfile.TemporaryFile() as sink:
    captured = _Captured(sink.fileno())
    _flush_stderr()
    try:
      saved = os.dup(2)
    except OSError:  # No descriptor 2 (e.g. a GUI process): capture the hook only.
      saved = None
    else:
      os.dup2(sink.fileno(), 2)
    hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_write_unraisable, sink.fileno())
    try:
      yield captured
    finally:
      sys.unraisablehook = hook
      _flush_stderr()
      if saved is not None:
        os.dup2(saved, 2)
        os.close(saved)
      sink.seek(0)
      captured.text = sink.read().decode("utf-8", errors="replace")


def _write_unraisable(fd: int, unraisable) -> None:
  text = "".join(traceback.format_exception(
      unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
  os.write(fd, text.encode("utf-8", errors="replace"))


def _flush_stderr() -> None:
  with contextlib.suppress(Exception):
    sys.stderr.flush()


def tree_equal(a: Any, b: Any) -> bool:
  """Bitwise equality of two pytrees of arrays (PRNG keys compared by key data)."""
  unwrap = lambda x: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.array_equal(unwrap(x), unwrap(y)) and unwrap(x).dtype == unwrap(y).dtype
      for x, y in zip(la, lb)
  )


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
  args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  with ocp.PyTreeCheckpointer() as reader:
    items = reader.restore(pathlib.Path(manager.directory) / str(step) / "state", args=args)
  if note is not None:
    items = _to_target_layout(items, abstract_state)
    log.info("%s (%s)", note, what)
  return _from_savable(abstract_state, items)
