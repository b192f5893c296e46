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
warning line per corrupt step; the full error, and everything the libraries
printed meanwhile, goes to `checkpoint-errors.log` beside the checkpoint
directory (in the workdir).

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
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as policies

from jax_ai_stack.errors import CheckpointMismatchError
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
  """The JSON metadata (config, step, ...) of a step (default newest), without arrays."""
  manager.wait_until_finished()
  step = manager.latest_step() if step is None else step
  restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  return restored["meta"]


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


@dataclasses.dataclass
class _Unreadable:
  """A step that failed to read; the error as text, so no traceback keeps Orbax's tasks alive."""

  step: int
  summary: str
  detail: str
  moved_to: pathlib.Path | None


def restore(
    manager: ocp.CheckpointManager, abstract_state: nnx.State, data_iterator: Any = None
) -> Restored | None:
  """Restores the newest good step into `abstract_state` (and `data_iterator`).

  Waits for a save in flight first. Returns None when the directory has no
  readable step. `data_iterator` None restores the state and metadata only (a
  read-only look at a run). A step that fails to read is moved aside as
  `<step>.corrupt` (left in place when the manager is read-only) and the
  previous step is tried; each such step gets one warning line, and the full
  error with everything printed while reading goes to `checkpoint-errors.log`
  in the checkpoint directory's parent (the system temp directory when
  read-only). A shape mismatch is not corruption: it raises
  `CheckpointMismatchError` at once.

  `abstract_state` is the state's shapes and dtypes without any arrays (so
  nothing is initialised just to be overwritten): the state of a model and
  optimizer built under `nnx.eval_shape`, e.g.
  `nnx.state(nnx.eval_shape(lambda: (model_fn(), optimizer_fn())))`. Leaves
  that carry a `sharding` are restored onto it.
  """
  manager.wait_until_finished()  # Until then the newest step is only <step>.orbax-checkpoint-tmp.
  unreadable: list[_Unreadable] = []
  restored = output = None
  try:
    with _stderr_captured() as output:
      try:
        restored = _restore_newest_readable(manager, abstract_state, data_iterator, unreadable)
      finally:
        if unreadable:
          manager.reload()  # Forget the steps moved aside.
          output.wait_until_quiet()
  finally:
    if unreadable:
      _report_unreadable(manager, unreadable, output.text if output else "", restored)
    elif output and output.text:
      sys.stderr.write(output.text)  # Nothing was unreadable: show what the libraries said.
  if restored is None:
    return None
  step, items, note = restored
  state = items["state"]
  if note is not None:  # Outside the loop: a failure here is no corruption of the step.
    state = _to_target_layout(state, abstract_state)
    log.info("%s", note)
  return Restored(step, _from_savable(abstract_state, state), items["meta"], note)


def _restore_newest_readable(manager, abstract_state, data_iterator, unreadable):
  """(step, Orbax's restored items, the layout note) of the newest step that reads, or None.

  Each step is read in its own layer layout (steps of one workdir may differ).
  """
  items = {"meta": ocp.args.JsonRestore()}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      target, note = _read_target(manager, step, abstract_state)
      items["state"] = ocp.args.StandardRestore(target)
      return step, manager.restore(step, args=ocp.args.Composite(**items)), note
    except CheckpointMismatchError:
      raise  # The config does not fit: not corruption, and no other step would fit either.
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable.
      moved = None if getattr(manager, "read_only", False) else _move_aside(manager, step)
      unreadable.append(_Unreadable(step, _first_line(e), "".join(traceback.format_exception(e)), moved))
  return None


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


def _report_unreadable(manager, unreadable: list[_Unreadable], output: str, restored) -> None:
  """One warning line per unreadable step; the detail goes to the error log."""
  log_path = _write_error_log(manager, unreadable, output)
  details = f"details in {log_path}" if log_path else "the details could not be written"
  fallback = f"restored step {restored[0]} instead" if restored else "no older step is readable"
  for item in unreadable:
    where = f"moved it to {item.moved_to.name}" if item.moved_to else "left it in place"
    log.warning("checkpoint step %d is unreadable (%s) in %s; %s, %s; %s", item.step,
                item.summary, manager.directory, where, fallback, details)


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
    parts.append(f"--- step {item.step} is unreadable ({where}):\n")
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
