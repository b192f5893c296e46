"""Restoring past corrupt steps: which errors are corruption, moving aside, the error log.

Restoring falls back past a corrupt newest step to the previous good one, moving
the corrupt directory aside as `<step>.corrupt` rather than deleting anything.
It prints one short warning line per corrupt step; the full error, and
everything the libraries printed meanwhile (with `capture_stderr=True`, as the
CLI passes), goes to
`checkpoint-errors.log` beside the checkpoint directory (in the workdir). Only a damaged
file counts as corruption (`corruption` says which errors): out of memory, an
I/O error or a bug raises as it is and moves nothing, and when no step reads,
`WorkdirError` names each step and why, and nothing is moved either (a run never
starts over at step 0). `restore` and `read_metadata` wait for a save in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import pathlib
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import grain
import msgpack
import orbax.checkpoint as ocp
from flax import nnx

from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes.checkpoint import capture
from jax_ai_stack.recipes.checkpoint.io import (_Damaged, _from_savable, _read_target,
                                                _to_target_layout, read_leaves)

log = logging.getLogger(__name__)

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


def read_metadata(manager: ocp.CheckpointManager, step: int | None = None, *,
                  capture_stderr: bool = False) -> dict:
  """The JSON metadata (config, step, ...) of `step`, without arrays.

  `step` None: the newest step whose metadata reads. Steps whose metadata file
  is damaged are passed over without a word (and never moved): the `restore`
  that follows says so, once. Raises `WorkdirError` when no step's metadata
  reads; any other failure (out of memory, an I/O error) raises as it is.
  `capture_stderr`: as `newest_readable`'s.
  """
  if step is not None:
    manager.wait_until_finished()
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  found = newest_readable(manager, functools.partial(_read_meta, manager), quiet=True,
                          capture_stderr=capture_stderr)
  if found is None:
    raise WorkdirError(f"no checkpoint in {manager.directory}")
  return found[1]


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
                    quiet: bool = False, capture_stderr: bool = False) -> tuple[int, _T] | None:
  """(step, `read(step)`) for the newest step whose files read; None when there is no step.

  The one recovery path of every command that reads a run. `read` wraps its
  reads of each item in `_reading`, so a damaged file raises
  `_StepUnreadable`; that step is passed over and the previous one tried. Once
  a step reads, each newer one is moved aside as `<step>.corrupt` (unless the
  manager is read-only) and gets one warning line; the full errors, with
  everything the libraries printed (with `capture_stderr`), go to
  `checkpoint-errors.log`. Nothing is moved before a step reads: when none does,
  `WorkdirError` names each step and why. Any other error (out of memory, I/O,
  a config that does not fit) raises at once and moves nothing. `quiet`: skip
  damaged steps without a word or a move. `capture_stderr`: redirect file
  descriptor 2 while steps are read (`capture.stderr_captured`); it changes the
  whole process's stderr, so a command line asks for it, a library call not.
  """
  manager.wait_until_finished()  # Until then the newest step is only <step>.orbax-checkpoint-tmp.
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    return None
  unreadable: list[_Unreadable] = []
  found = output = None
  try:
    with capture.stderr_captured(capture_stderr) as output:
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
    manager: ocp.CheckpointManager, abstract_state: nnx.State, data_iterator: Any = None, *,
    capture_stderr: bool = False, subset: bool = False,
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
  that carry a `sharding` are restored onto it. `capture_stderr`: as
  `newest_readable`'s. `subset`: `abstract_state` is a part of what was saved (a
  finished run's model, not its optimizer state), and only that part is read.
  """
  found = newest_readable(manager, functools.partial(
      _read_step, manager, abstract_state=abstract_state, data_iterator=data_iterator,
      subset=subset), capture_stderr=capture_stderr)
  if found is None:
    return None
  step, (metadata, state, note) = found
  if note is not None:  # Outside the loop: a failure here is no corruption of the step.
    state = _to_target_layout(state, abstract_state)
    log.info("%s", note)
  return Restored(step, _from_savable(abstract_state, state), metadata, note)


def _read_step(manager, step: int, *, abstract_state, data_iterator, subset: bool = False):
  """(metadata, Orbax's state tree, layout note) of `step`, item by item to name a damaged one.

  Each step is read in its own layer layout (steps of one workdir may differ).
  The data position is read last, so a step whose state is damaged leaves
  `data_iterator` alone.
  """
  step_dir = pathlib.Path(manager.directory) / str(step)
  _check_items(step_dir, ["meta", "state"] + (["data"] if data_iterator is not None else []))
  metadata = _read_meta(manager, step)
  with _reading(step_dir, "state"):
    target, note = _read_target(manager, step, abstract_state, subset=subset)
    if subset:
      state = read_leaves(step_dir / "state", target)
    else:
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
