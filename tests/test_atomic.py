"""write_atomically: the old contents or the new, fsynced, and no temp file left behind."""

from __future__ import annotations

import os

import pytest

from jax_ai_stack import atomic


def test_replaces_text_and_bytes(tmp_path):
  path = tmp_path / "a.txt"
  atomic.write_atomically(path, "héllo\n")
  assert path.read_text(encoding="utf-8") == "héllo\n"
  atomic.write_atomically(str(path), b"\x00\x01")
  assert path.read_bytes() == b"\x00\x01"
  assert os.listdir(tmp_path) == ["a.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp_file(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  path.write_text("old\n")

  def killed(*args):
    raise KeyboardInterrupt  # As a signal between write and rename would.

  monkeypatch.setattr(atomic.os, "replace", killed)
  with pytest.raises(KeyboardInterrupt):
    atomic.write_atomically(path, "new\n")
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_fsyncs_the_file_then_the_directory(tmp_path, monkeypatch):
  if not os.path.exists("/proc/self/fd"):
    pytest.skip("needs /proc to name the synced descriptors")
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                      or real_fsync(fd))
  atomic.write_atomically(tmp_path / "a.txt", "x")
  assert len(synced) == 2
  assert os.path.basename(synced[0]).startswith(".a.txt.")  # The temp file, before the rename.
  assert synced[1] == str(tmp_path)


def test_keeps_the_permissions_of_the_file_it_replaces(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("old")
  path.chmod(0o640)
  atomic.write_atomically(path, "new")
  assert path.stat().st_mode & 0o777 == 0o640
  fresh = tmp_path / "b.txt"
  atomic.write_atomically(fresh, "new")
  assert fresh.stat().st_mode & 0o777 == 0o666 & ~atomic._umask()  # Not mkstemp's 0600.
