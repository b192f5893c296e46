"""Checkpoints: async saves that are never lost, quiet recovery from a corrupt step,
deletion that a kill cannot split, retention on open, and read-only managers."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import stat
import subprocess

import grain
import jax
import pytest
from flax import nnx

from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes import checkpoint

from multidevice import run_program

TMP_SUFFIX = ".orbax-checkpoint-tmp"


class Tiny(nnx.Module):
  """Integer keys (a list), a typed PRNG key and its counter: what trips up key handling."""

  def __init__(self, seed: int, width: int = 3):
    self.layers = nnx.List([nnx.Linear(2, width, rngs=nnx.Rngs(seed)),
                            nnx.Linear(width, 2, rngs=nnx.Rngs(seed + 1))])
    self.rngs = nnx.Rngs(dropout=seed)


def _state(seed=0, width=3):
  return nnx.state(Tiny(seed, width))


def _abstract(width=3):
  return nnx.eval_shape(lambda: nnx.state(Tiny(7, width)))


def _data(position=0):
  iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
  for _ in range(position):
    next(iterator)
  return iterator


def _manager(directory, **config):
  return checkpoint.build_manager(directory, checkpoint.CheckpointConfig(**{"save_every": 1, **config}))


def _save_steps(directory, steps, **config):
  manager = _manager(directory, **{"keep_last": 100, **config})
  for step in steps:
    assert checkpoint.save(manager, step, _state(step), _data(step), {"step": step}, force=True)
  manager.close()


def _run_python(program: str, *args) -> subprocess.CompletedProcess:
  """A fresh interpreter, so exit hooks run and absl/TensorStore/asyncio output is seen."""
  return run_program(program, *args, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _listing(directory: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(directory)) for p in directory.iterdir())


@pytest.fixture
def directory(tmp_path):
  """The checkpoint directory: an error log beside it stays inside tmp_path."""
  return tmp_path / "checkpoints"


# ---- async saves --------------------------------------------------------------


def test_restore_right_after_an_async_save_waits_for_it(directory):
  manager = _manager(directory)
  state = _state(0)
  with manager.async_saves():
    assert manager.saves_in_background
    assert checkpoint.save(manager, 1, state, _data(3), {"step": 1}, force=True)
    data = _data()
    restored = checkpoint.restore(manager, _abstract(), data)  # The save may be in flight.
  assert restored.step == 1 and restored.metadata == {"step": 1}
  assert checkpoint.tree_equal(restored.state, state)  # Bitwise, PRNG key and int keys too.
  assert next(data) == 3  # The data position came back too.
  assert checkpoint.read_metadata(manager) == {"step": 1}
  manager.close()
  manager.close()  # Closing twice is harmless.
  assert _listing(directory) == ["1"]


def test_a_save_outside_a_block_is_on_disk_when_it_returns(directory):
  manager = _manager(directory)
  assert not manager.saves_in_background
  assert checkpoint.save(manager, 1, _state(), _data(), {"step": 1}, force=True)
  assert _listing(directory) == ["1"]  # Not 1.orbax-checkpoint-tmp: nothing left in flight.
  manager.close()


def test_with_manager_saves_in_the_background_then_waits_and_closes(directory):
  with _manager(directory) as manager:
    assert manager.saves_in_background
    assert checkpoint.save(manager, 1, _state(), _data(), {"step": 1}, force=True)
  assert not manager.saves_in_background
  assert _listing(directory) == ["1"]
  with _manager(directory, async_save=False) as manager:
    assert not manager.saves_in_background  # The config turned background saves off.


def test_an_in_flight_step_is_never_moved_aside(directory, monkeypatch):
  manager = _manager(directory)
  with manager.async_saves():
    checkpoint.save(manager, 1, _state(), _data(), {"step": 1}, force=True)
    real_wait = manager.wait_until_finished
    monkeypatch.setattr(manager, "wait_until_finished", lambda: None)  # As if restore did not wait.
    with pytest.raises(WorkdirError, match=r"\(step 1: not on disk yet\); nothing was moved"):
      checkpoint.restore(manager, _abstract())
    real_wait()
    monkeypatch.undo()
  assert not list(directory.glob("*.corrupt*"))
  manager.reload()
  assert checkpoint.restore(manager, _abstract()).step == 1
  manager.close()


def test_a_script_that_ends_right_after_save_keeps_the_step(directory):
  # No close(), no wait, no block: the interpreter exits at once.
  result = _run_python("checkpoint_save_then_exit", directory)
  assert result.returncode == 0, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  assert _listing(directory) == ["1"]
  manager = _manager(directory)
  assert checkpoint.read_metadata(manager) == {"step": 1}
  manager.close()


# ---- a corrupt step -----------------------------------------------------------


def test_a_corrupt_newest_step_prints_one_line_and_logs_the_detail(tmp_path):
  directory = tmp_path / "checkpoints"
  _save_steps(directory, [1, 2])
  arrays = [p for p in (directory / "2" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert arrays
  for path in arrays:  # Truncated array data: opening each array fails.
    path.write_bytes(b"garbage")
  result = _run_python("checkpoint_restore_past_a_corrupt_step", directory)
  assert result.returncode == 0, result.stderr
  assert result.stdout == "restored 1\n"
  lines = result.stderr.splitlines()
  assert len(lines) <= 2, result.stderr
  [warning] = [line for line in lines if "step 2" in line]
  assert warning == ("warning: checkpoint step 2 is unreadable (state: truncated); moved aside to "
                     "2.corrupt, resuming from step 1")
  assert _listing(directory) == ["1", "2.corrupt"]
  detail = (tmp_path / checkpoint.ERROR_LOG).read_text()
  assert "step 2 is unreadable" in detail and "Traceback" in detail and "tensorstore_spec" in detail


@pytest.mark.parametrize("turned_on", [False, True])
def test_only_a_caller_that_asks_has_stderr_captured_during_recovery(directory, turned_on):
  # A library call must not redirect a notebook's stderr; the CLI asks for the capture.
  _save_steps(directory, [1])
  manager = _manager(directory)
  before = os.fstat(2)
  seen = []

  def read(step):
    now = os.fstat(2)
    seen.append((now.st_dev, now.st_ino) != (before.st_dev, before.st_ino))
    return step

  try:
    assert checkpoint.recovery.newest_readable(manager, read, capture_stderr=turned_on) == (1, 1)
  finally:
    manager.close()
  assert seen == [turned_on]


def test_a_shape_mismatch_raises_and_moves_nothing(directory):
  _save_steps(directory, [1])
  manager = _manager(directory)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"layers/0/kernel: checkpoint shape \(2, 3\), config shape \(2, 5\)"):
    checkpoint.restore(manager, _abstract(width=5))
  manager.close()
  assert _listing(directory) == ["1"]


# ---- deletion and retention ---------------------------------------------------


def test_a_kill_while_deleting_an_old_step_never_leaves_half_a_step(directory, monkeypatch):
  class Killed(BaseException):
    pass

  def killed(*args, **kwargs):
    raise Killed

  manager = _manager(directory, keep_last=1, async_save=False)
  checkpoint.save(manager, 1, _state(), _data(), {"step": 1}, force=True)
  monkeypatch.setattr(shutil, "rmtree", killed)  # The process dies when removing files starts.
  with pytest.raises(Killed):
    checkpoint.save(manager, 2, _state(), _data(), {"step": 2}, force=True)
  monkeypatch.undo()
  assert not (directory / "1").exists()  # Renamed out of the step namespace first.
  reopened = _manager(directory, keep_last=1)
  assert reopened.all_steps() == [2]
  assert _listing(directory) == ["2"]  # The trash was emptied.
  reopened.close()


def test_opening_removes_a_half_deleted_step_left_in_the_trash(directory):
  _save_steps(directory, [1, 2])
  trash = directory / checkpoint.TRASH_DIR
  trash.mkdir()
  shutil.move(directory / "1", trash / "1")
  for path in sorted((trash / "1").rglob("*"))[:5]:  # Half removed when the process died.
    if path.is_file():
      path.unlink()
  manager = _manager(directory)
  assert manager.all_steps() == [2]
  manager.close()
  assert _listing(directory) == ["2"]


def test_opening_applies_the_retention_policy(directory):
  _save_steps(directory, [1, 2, 3, 4])  # As if killed after saving 4, before deleting 1.
  manager = _manager(directory, keep_last=3)
  assert manager.all_steps() == [2, 3, 4]
  manager.close()
  assert _listing(directory) == ["2", "3", "4"]
  manager = _manager(directory, keep_last=1, keep_every=3)
  assert manager.all_steps() == [3, 4]
  manager.close()


def test_saving_keeps_keep_last_and_multiples_of_keep_every(directory):
  manager = _manager(directory, keep_last=2, keep_every=2)
  for step in range(1, 8):
    checkpoint.save(manager, step, _state(), _data(), {"step": step})
  manager.close()
  assert _listing(directory) == ["2", "4", "6", "7"]


# ---- read-only ----------------------------------------------------------------


def _snapshot(directory: pathlib.Path) -> dict:
  """Every path under `directory` with its mtime and content hash."""
  return {
      str(path): (path.lstat().st_mtime_ns,
                  hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None)
      for path in [directory, *directory.rglob("*")]
  }


def _chmod_tree(directory: pathlib.Path, writable: bool) -> None:
  for path in [directory, *directory.rglob("*")]:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_a_read_only_manager_writes_nothing(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "system-tmp"))
  (tmp_path / "system-tmp").mkdir()
  workdir = tmp_path / "run"
  directory = workdir / "checkpoints"
  _save_steps(directory, [1, 2, 3])
  for path in (directory / "3" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.write_bytes(b"garbage")  # A corrupt newest step: skipped, not moved.
  (directory / f"4{TMP_SUFFIX}").mkdir()  # A killed save's leftovers: not cleaned up.
  (directory / checkpoint.TRASH_DIR / "0").mkdir(parents=True)
  before = _snapshot(workdir)
  _chmod_tree(workdir, writable=False)
  try:
    really_read_only = not os.access(directory, os.W_OK)  # Root ignores the mode bits.
    manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=True)
    assert manager.latest_step() == 3
    assert checkpoint.read_metadata(manager, 2) == {"step": 2}
    restored = checkpoint.restore(manager, _abstract(), None)
    assert restored.step == 2 and checkpoint.tree_equal(restored.state, _state(2))
    assert not checkpoint.save(manager, 5, _state(), _data(), {"step": 5}, force=True)
    manager.close()
    missing = tmp_path / "missing"
    checkpoint.build_manager(missing, checkpoint.CheckpointConfig(), read_only=True).close()
    assert not missing.exists()
  finally:
    _chmod_tree(workdir, writable=True)
  assert _snapshot(workdir) == before, f"chmod effective: {really_read_only}"
  assert "Given directory is read only" not in caplog.text  # Orbax's notice at every open.
  assert "step 3" in (tmp_path / "system-tmp" / f"jax-ai-stack-{checkpoint.ERROR_LOG}").read_text()


# ---- what counts as corruption (fails closed) ----------------------------------


@pytest.mark.parametrize("error, reason", [
    (json.JSONDecodeError("Expecting value", "garbage", 0), "not valid JSON"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not valid UTF-8 text"),
    (FileNotFoundError("File /c/2/meta/metadata not found."), "missing"),
    (ValueError("File /c/2/data/process_0-of-1.json does not exist."), "missing"),
    (ValueError('DATA_LOSS: Error reading "a/.zarray" in OCDBT database'), "damaged data"),
    (ValueError("OUT_OF_RANGE: Error opening \"zarr\" driver: ..."), "truncated"),
    (ValueError('NOT_FOUND: Error reading local file "/c/2/state/_sharding"'), "missing"),
    (ValueError('FAILED_PRECONDITION: Error reading local file "x": Invalid JSON'), "not valid JSON"),
    (ValueError("Error reading ...: Data corruption detected [tensorstore_spec='{}']"),
     "damaged data"),
])
def test_a_damaged_file_is_corruption(error, reason):
  assert checkpoint.corruption(error) == reason


@pytest.mark.parametrize("error", [
    MemoryError(),
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes."),
    ValueError("RESOURCE_EXHAUSTED: Error reading local file [OS error: Cannot allocate memory]"),
    OSError(errno.EIO, "Input/output error"),
    OSError(errno.EAGAIN, "Resource temporarily unavailable"),
    PermissionError(errno.EACCES, "Permission denied"),
    ValueError('FAILED_PRECONDITION: Error reading local file "x" [OS error: Input/output error]'),
    ValueError("UNAVAILABLE: connection reset"),
    TypeError("unsupported operand type(s)"),
    KeyError("layers"),
    ValueError("a plain bug"),
    checkpoint.CheckpointMismatchError("does not fit"),
])
def test_anything_else_is_not_corruption(error):
  assert checkpoint.corruption(error) is None


def _fail_state_restore(monkeypatch, manager, error, step):
  """Orbax's restore of `step`'s state raises `error`; everything else reads as usual."""
  real = manager.restore

  def restore(at, *args, **kwargs):
    if at == step and "state" in kwargs.get("args", {}).keys():
      raise error
    return real(at, *args, **kwargs)

  monkeypatch.setattr(manager, "restore", restore)


def _garble(directory: pathlib.Path, step: int, name: str = "meta/metadata") -> None:
  (directory / str(step) / name).write_text('{"step": 3, "conf')  # Cut mid-write.


@pytest.mark.parametrize("error", [
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes."),
    MemoryError(),
    OSError(errno.EIO, "Input/output error"),
    TypeError("a bug"),
])
def test_an_error_that_is_not_corruption_raises_and_moves_nothing(directory, monkeypatch, error):
  _save_steps(directory, [1, 2, 3])
  _garble(directory, 3)  # Damaged, but step 2 fails otherwise: nothing may move.
  manager = _manager(directory)
  _fail_state_restore(monkeypatch, manager, error, step=2)
  with pytest.raises(type(error)) as raised:
    checkpoint.restore(manager, _abstract(), _data())
  assert raised.value is error  # As it is, with its traceback.
  manager.close()
  assert _listing(directory) == ["1", "2", "3"]


def test_garbled_metadata_is_moved_aside_with_one_short_line(directory, capsys):
  _save_steps(directory, [1, 2, 3])
  _garble(directory, 3)
  manager = _manager(directory)
  assert checkpoint.read_metadata(manager) == {"step": 2}  # Skips it without a word.
  assert capsys.readouterr().err == ""
  assert _listing(directory) == ["1", "2", "3"]
  restored = checkpoint.restore(manager, _abstract(), _data())
  assert restored.step == 2 and checkpoint.tree_equal(restored.state, _state(2))
  assert capsys.readouterr().err == (
      "warning: checkpoint step 3 is unreadable (meta/metadata: not valid JSON); moved aside to "
      "3.corrupt, resuming from step 2\n")
  assert manager.all_steps() == [1, 2]
  manager.close()
  assert _listing(directory) == ["1", "2", "3.corrupt"]
  assert "step 3 is unreadable (meta/metadata: not valid JSON; moved to" in (
      directory.parent / checkpoint.ERROR_LOG).read_text()


def test_a_read_only_manager_skips_a_damaged_step_and_moves_nothing(directory, capsys):
  _save_steps(directory, [1, 2, 3])
  _garble(directory, 3)
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=True)
  assert checkpoint.restore(manager, _abstract()).step == 2
  manager.close()
  assert capsys.readouterr().err == (
      "warning: checkpoint step 3 is unreadable (meta/metadata: not valid JSON); skipped, using "
      "step 2\n")
  assert _listing(directory) == ["1", "2", "3"]


@pytest.mark.parametrize("read_only", [False, True])
def test_when_no_step_reads_the_error_names_each_and_nothing_moves(directory, read_only):
  _save_steps(directory, [1, 2])
  _garble(directory, 2)
  (directory / "1" / "data" / "process_0-of-1.json").unlink()
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=read_only)
  message = (r"no checkpoint step in .*checkpoints is readable \(step 2: meta/metadata: not valid "
             r"JSON; step 1: data/process_0-of-1.json: missing\); nothing was moved")
  with pytest.raises(WorkdirError, match=message):
    checkpoint.restore(manager, _abstract(), _data())
  assert checkpoint.read_metadata(manager) == {"step": 1}  # Its metadata reads.
  _garble(directory, 1)
  with pytest.raises(WorkdirError, match=r"\(step 2: .*; step 1: meta/metadata: not valid JSON\)"):
    checkpoint.read_metadata(manager)
  manager.close()
  assert _listing(directory) == ["1", "2"]
