"""Capturing everything written to stderr's file descriptor meanwhile.

What a corrupt step makes Orbax, absl, asyncio and TensorStore's threads print
(thousands of lines) goes to the error log instead of the terminal. Redirecting
file descriptor 2 changes it for the whole process, so recovery does it only
when its caller passes `capture_stderr=True` (the `jax-ai-stack` commands do);
a library call leaves a notebook's stderr alone.

Example:
  >>> import os
  >>> with stderr_captured() as captured:
  ...   _ = os.write(2, b"thousands of lines")
  >>> captured.text
  'thousands of lines'
  >>> with stderr_captured(enabled=False) as captured:  # Nothing is redirected.
  ...   pass
  >>> captured.fd is None
  True
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import tempfile
import time
import traceback


class _Captured:
  """Output captured into the file `fd`; `text` once the capture has ended (fd None: none)."""

  def __init__(self, fd: int | None):
    self.fd = fd
    self.text = ""

  def wait_until_quiet(self, quiet_s: float = 0.2, limit_s: float = 2.0) -> None:
    """Keeps capturing until nothing new was written for `quiet_s` seconds.

    After a failed read, TensorStore's threads go on completing the reads Orbax
    abandoned, each printing a traceback, and asyncio reports its abandoned
    tasks when they are collected: a few milliseconds, after the error.
    """
    if self.fd is None:
      return
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
def stderr_captured(enabled: bool = True):
  """Everything written to file descriptor 2 meanwhile, as `.text` afterwards.

  A corrupt step makes Orbax, absl, asyncio and TensorStore's threads print
  thousands of lines (specs; one "Event loop is closed" traceback per pending
  read, through `sys.unraisablehook`); only the file descriptor catches them
  all. The hook is redirected too, in case something (pytest) replaced it.
  `enabled` False: nothing is redirected, and `.text` stays "".
  """
  if not enabled:
    yield _Captured(None)
    return
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
