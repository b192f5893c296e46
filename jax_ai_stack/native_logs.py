"""Native log lines (XLA's, PJRT's, absl's C++ logging) routed like the Python libraries'.

C++ code logs straight to file descriptor 2, past Python's `logging`, so
`logs.routed` never sees it: an XLA warning such as `spmd_partitioner.cc ...
Involuntary full rematerialization` lands between the progress bar and the
results. `kept_off_console` points descriptor 2 at a pipe read by a small
filter process: lines in absl's format (`W1125 21:40:17.123456  4242
spmd_partitioner.cc:652] ...`) at INFO and WARNING are kept aside; errors and
everything else (our messages, tracebacks, a progress bar's partial lines) pass
to the terminal unchanged and at once. When the block ends, each kept line
becomes a log record (logger `native.<file>`), so it follows the Python rule:
into the workdir's log file, counted in the end-of-command note, on the
console only with `--verbose` (which does not filter at all).

A process rather than a thread: when XLA aborts the process (a failed CHECK),
the filter still drains the pipe, so the fatal line reaches the terminal.
Only `cli` filters, once per command, and only where descriptor 2 is the
process's stderr (a notebook's or pytest's captured stream is left alone).

This module imports the standard library only: the filter runs it as a
script (`python -I -S native_logs.py SPOOL`).

Example: the lines the filter keeps aside, and one it lets through.
  >>> kept(b"W1125 21:40:17.123456  4242 spmd_partitioner.cc:652] Involuntary full remat",
  ...      after_kept=False)
  True
  >>> kept(b"E1125 21:40:17.123456  4242 pjrt_client.cc:1] an error", after_kept=False)
  False
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

LINE = re.compile(rb"([IWEF])\d{4} [\d:.]+\s+\d+ ([^:\]\s]+):\d+\] ")
"""The head of an absl/glog line: level, date, time, thread, file:line."""
_PARTIAL = re.compile(rb"[IWEF](\d{0,4}|\d{4} [\d:.]*(\s+\d*( [^\]\n]*)?)?)")
"""A line's start that may still become `LINE`'s head: held until its newline."""
ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called"
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_WAIT_S = 5.0


def kept(line: bytes, after_kept: bool) -> bool:
  """Whether a line (without its newline) is native INFO/WARNING logging, to keep aside.

  `after_kept`: the previous line was kept; an indented line then continues it.
  """
  head = LINE.match(line)
  if head:
    return head.group(1) in b"IW"
  return line.startswith(ABSL_PREAMBLE) or (after_kept and line[:1] in (b" ", b"\t"))


def _filter(spool_path: str) -> None:
  """The filter process: stdin (the command's descriptor 2) to stderr (the terminal),
  the lines `kept` says into the spool file."""
  for sig in (signal.SIGINT, signal.SIGTERM):  # Drain until the command closes the pipe.
    signal.signal(sig, signal.SIG_IGN)
  with open(spool_path, "ab") as spool:
    pending, after_kept = b"", False
    while chunk := os.read(0, 1 << 16):
      pending += chunk
      shown = []
      *lines, pending = pending.split(b"\n")
      for line in lines:
        after_kept = kept(line, after_kept)
        (spool.write if after_kept else shown.append)(line + b"\n")
      if pending and not (LINE.match(pending) or _PARTIAL.fullmatch(pending)):
        shown.append(pending)  # A partial line that is no log line (a progress bar): now.
        pending = b""
      spool.flush()
      if shown:
        os.write(2, b"".join(shown))
    if pending:
      os.write(2, pending)


def _records(spool: bytes) -> list[logging.LogRecord]:
  """Each kept line (with its indented continuation lines) as a log record of
  logger `native.<file stem>`."""
  records: list[logging.LogRecord] = []
  for raw in spool.decode("utf-8", errors="replace").splitlines():
    if records and raw[:1] in (" ", "\t"):
      records[-1].msg += "\n" + raw
      continue
    head = LINE.match(raw.encode("utf-8", errors="replace"))
    name = "native." + (head.group(2).decode().rsplit(".", 1)[0] if head else "absl")
    level = _LEVELS[raw[0]] if head else logging.INFO
    records.append(logging.getLogger(name).makeRecord(name, level, "(native)", 0, raw, None, None))
  return records


@contextlib.contextmanager
def kept_off_console(enabled: bool = True) -> Iterator[None]:
  """Native INFO/WARNING lines written to descriptor 2 meanwhile go to Python's logging
  at the end of the block instead of the terminal (see the module docstring).

  Does nothing when not `enabled`, off POSIX, or when `sys.stderr` is not the
  process's descriptor 2.
  """
  if not enabled or os.name != "posix" or not _stderr_is_fd_2():
    yield
    return
  with tempfile.NamedTemporaryFile(prefix="jax-ai-stack-native-", suffix=".log") as spool:
    read_end, write_end = os.pipe()
    try:
      child = subprocess.Popen([sys.executable, "-I", "-S", __file__, spool.name],
                               stdin=read_end, close_fds=True)
    except OSError:
      os.close(read_end)
      os.close(write_end)
      yield
      return
    os.close(read_end)
    sys.stderr.flush()
    console = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)
    stderr, sys.stderr = sys.stderr, _Terminal(sys.stderr, console)
    try:
      yield
    finally:
      sys.stderr = stderr
      with contextlib.suppress(Exception):
        sys.stderr.flush()
      os.dup2(console, 2)  # The pipe's last write end closes: the filter drains and ends.
      os.close(console)
      with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(_WAIT_S)  # Longer only when a process we started still holds the pipe.
      for record in _records(pathlib.Path(spool.name).read_bytes()):
        logging.getLogger(record.name).handle(record)


class _Terminal:
  """`sys.stderr` while the filter runs: it writes through descriptor 2 (the pipe), but
  `isatty` and `fileno` answer for the terminal behind it, so a progress bar stays
  a bar of the terminal's width."""

  def __init__(self, stream, console_fd: int):
    self._stream, self._console_fd = stream, console_fd

  def isatty(self) -> bool:
    return os.isatty(self._console_fd)

  def fileno(self) -> int:
    return self._console_fd

  def __getattr__(self, name):
    return getattr(self._stream, name)


def _stderr_is_fd_2() -> bool:
  try:
    return sys.stderr is not None and sys.stderr.fileno() == 2
  except (AttributeError, OSError, ValueError):
    return False


if __name__ == "__main__":
  _filter(sys.argv[1])
