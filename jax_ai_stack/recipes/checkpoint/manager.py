"""The checkpoint manager: Orbax's, made unable to lose a save at exit, with retention on open.

Saves can run in the background (`CheckpointConfig.async_save`), but only
inside a block that waits for them at its end: `with manager:` (which closes
the manager) or `with manager.async_saves():` (what the trainer's loop uses).
There `save` returns once the arrays are copied to host memory and a thread
writes them. Anywhere else `save` returns when the step is on disk, so a
script that ends right after `save` never loses it: from Python 3.12 on, no
thread can start once the main script has ended, and Orbax needs new threads to
finish a step.

Old steps (beyond `keep_last`, except multiples of `keep_every`) are deleted
only after the new step is complete, in two moves that a kill cannot split:
Orbax renames the step into `<checkpoint dir>/todelete/` and this module then
removes it. Opening a manager finishes both, and applies the retention rule to
what is on disk (a run killed right after its last save has one step too many).

Example:
  >>> from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig
  >>> manager = build_manager("checkpoints", CheckpointConfig(save_every=10))
  >>> manager.latest_step(), manager.directory.name, manager.directory.is_dir()
  (None, 'checkpoints', True)
  >>> manager.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import pathlib
import shutil
import threading
import weakref

import grain
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_ai_stack.recipes.checkpoint_config import CheckpointConfig

log = logging.getLogger(__name__)

TRASH_DIR = "todelete"
"""Orbax's `todelete_subdir`: old steps are renamed into it, then removed."""


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
