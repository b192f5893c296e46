"""Replacing a file so that a crash leaves the old contents or the new, never half.

A run rewrites some files in its workdir (metrics.jsonl cut back on resume, the
loss plot, samples). Writing in place (truncate, then write) loses the old
contents if the process is killed in between. `write_atomically` writes a
temporary file in the same directory, flushes it to disk, and renames it over
the target: `os.replace` is atomic on POSIX and Windows, so a reader sees
either the complete old file or the complete new one. The directory is synced
too (POSIX), so the rename itself survives a power loss.

Example:
  >>> write_atomically("notes.txt", "one\\n")
  >>> write_atomically("notes.txt", b"two\\n")
  >>> open("notes.txt").read()
  'two\\n'
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import tempfile

_NEW_FILE_MODE = 0o666


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
  """Replaces `path` with `data` (text is UTF-8) in one atomic rename.

  The temporary file is fsynced before the rename, so the new name never
  points at unwritten data; it is removed if anything fails, so a failed write
  leaves the directory as it was. The file keeps the permissions of the one it
  replaces (a new file gets the usual umask-based ones, not mkstemp's 0600).

  Args:
    path: the file to create or replace; its directory must exist.
    data: the whole new contents.
  """
  path = pathlib.Path(path)
  payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, _mode_for(path))
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  fsync_directory(path.parent)


def fsync_directory(directory: str | os.PathLike) -> None:
  """Flushes a directory's entries (a rename, a new file) to disk; POSIX only.

  Windows cannot open a directory for syncing, and its renames need no extra
  step, so this does nothing there.
  """
  if os.name != "posix":
    return
  fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _mode_for(path: pathlib.Path) -> int:
  """The permission bits the replacement should have."""
  try:
    return path.stat().st_mode & 0o7777
  except FileNotFoundError:
    return new_file_mode()


def new_file_mode() -> int:
  """The bits `open()` gives a new file (0o644 under the usual umask), not mkstemp's 0o600."""
  return _NEW_FILE_MODE & ~_umask()


def new_directory_mode() -> int:
  """The bits `mkdir` gives a new directory (0o755 under the usual umask), not mkdtemp's 0o700."""
  return 0o777 & ~_umask()


@functools.cache
def _umask() -> int:
  # The only way to read the umask is to set it (process-wide), so read it once.
  mask = os.umask(0o22)
  os.umask(mask)
  return mask
