"""Where a command's log records go: the libraries' chatter to a file, ours to the console.

tokamax, Orbax, Grain and JAX log through Python's `logging` (tokamax through
absl): on a GPU tokamax alone writes hundreds of "Autotuning cache miss" lines
a run, several hundred characters each, in between the progress bar and the
results. The command line routes them once, for the whole command: every
record at INFO and above goes to `<workdir>/jax-ai-stack.log`; the console
shows this package's warnings (and its info with `--verbose`) and the other
libraries' errors; the libraries' warnings and info reach the console only
with `--verbose`. At the end one line says how many were kept off it, and
where they are. A library call never routes anything: only `cli` does, once
per command. Handlers already on the root logger (a notebook's, pytest's)
stay; ours are added beside them and removed after.

Example:
  >>> import logging, pathlib, tempfile
  >>> path = pathlib.Path(tempfile.mkdtemp()) / LOG_FILE
  >>> with routed(path, verbose=False) as routes:
  ...   logging.getLogger("absl").warning("Autotuning cache miss for %s", "op")
  >>> routes.hidden
  1
  >>> "Autotuning cache miss for op" in path.read_text()
  True
"""

from __future__ import annotations

import collections
import contextlib
import logging
import logging.handlers
import pathlib
import sys
from collections.abc import Iterator

LOG_FILE = "jax-ai-stack.log"
OWN_LOGGER = "jax_ai_stack"


def _own(record: logging.LogRecord) -> bool:
  return record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")


class _Console(logging.Handler):
  """The console's share: ours from WARNING (INFO when verbose), the rest from ERROR."""

  def __init__(self, stream, verbose: bool):
    super().__init__(logging.INFO)
    self._stream, self.verbose = stream, verbose
    self.hidden: collections.Counter[str] = collections.Counter()
    self._ours = logging.Formatter("%(message)s")
    self._theirs = logging.Formatter("%(name)s: %(message)s")

  def format(self, record: logging.LogRecord) -> str:
    return (self._ours if _own(record) else self._theirs).format(record)

  def emit(self, record: logging.LogRecord) -> None:
    shown = self.verbose or record.levelno >= (logging.WARNING if _own(record) else logging.ERROR)
    if not shown:
      if not _own(record) and record.levelno >= logging.WARNING:
        self.hidden[record.name] += 1  # Their info goes to the file without a word.
      return
    stream = self._stream if self._stream is not None else sys.stderr  # capsys swaps it.
    try:
      stream.write(self.format(record) + "\n")
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


class _WorkdirFile(logging.FileHandler):
  """The whole log, opened at the first record; a workdir that cannot be written
  (an archived run, read-only) turns it off instead of printing logging's errors."""

  def __init__(self, path: pathlib.Path):
    super().__init__(path, encoding="utf-8", delay=True)
    self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    self.failed = False

  def emit(self, record: logging.LogRecord) -> None:
    if self.failed:
      return
    try:
      pathlib.Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
      if self.stream is None:
        self.stream = self._open()
    except OSError:
      self.failed = True
      return
    super().emit(record)


class Routes:
  """What `routed` set up: the console's share, the log file once `keep_in` names it."""

  def __init__(self, console: _Console):
    self._console, self._file = console, None
    self._held: logging.handlers.MemoryHandler | None = None

  def keep_in(self, path: pathlib.Path, *, held: bool = False) -> None:
    """From now on every record also goes to `path` (created with its folder at the first
    record): a command calls it once it knows its workdir.

    `held`: the records wait in memory until `release()`; a command that fails
    before it releases them (bad input) writes nothing into the workdir.
    """
    if self._file is not None:
      raise ValueError(f"the log already goes to {self._file.baseFilename}")
    self._file = _WorkdirFile(pathlib.Path(path))
    if held:  # No target yet: MemoryHandler keeps every record until it gets one.
      self._held = logging.handlers.MemoryHandler(
          capacity=1, flushLevel=logging.CRITICAL + 1, target=None, flushOnClose=False)
    logging.getLogger().addHandler(self._held or self._file)

  def release(self) -> None:
    """The held records go to the file now, and every record after them."""
    if self._held is None:
      return
    root = logging.getLogger()
    self._held.setTarget(self._file)
    self._held.flush()
    root.removeHandler(self._held)
    self._held.close()
    self._held = None
    root.addHandler(self._file)

  @property
  def hidden(self) -> int:
    return sum(self._console.hidden.values())

  @property
  def path(self) -> pathlib.Path | None:
    if self._file is None or self._file.failed or self._held is not None:
      return None
    return pathlib.Path(self._file.baseFilename)

  def summary(self) -> str | None:
    """One line on the warnings kept off the console, or None when there were none."""
    if not self.hidden:
      return None
    by_logger = ", ".join(f"{name} {count}" for name, count in self._console.hidden.most_common(3))
    where = f"in {self.path}" if self.path else "not kept"
    return (f"note: {self.hidden} library warnings ({by_logger}) kept off the console, "
            f"{where}; --verbose shows them")

  def _close(self) -> None:
    root = logging.getLogger()
    root.removeHandler(self._console)
    if self._held is not None:  # Never released: the held records are dropped.
      root.removeHandler(self._held)
      self._held.close()
    if self._file is not None:
      root.removeHandler(self._file)
      self._file.close()


@contextlib.contextmanager
def routed(path: pathlib.Path | None, *, verbose: bool, stream=None) -> Iterator[Routes]:
  """Routes every log record of the block as the module says; restores logging after.

  Args:
    path: the log file (created with its folder at the first record; usually
      `log_path(workdir)`); None: none until `Routes.keep_in` names one.
    verbose: the libraries' warnings and info, and ours, on the console too.
    stream: the console (default: stderr at the time of each record).
  """
  root = logging.getLogger()
  routes = Routes(_Console(stream, verbose))
  saved_level = root.level
  root.addHandler(routes._console)  # pylint: disable=protected-access
  root.setLevel(logging.INFO)
  try:
    if path is not None:
      routes.keep_in(path)
    yield routes
  finally:
    routes._close()  # pylint: disable=protected-access
    root.setLevel(saved_level)


def log_path(workdir: pathlib.Path, process_index: int = 0) -> pathlib.Path:
  """The workdir's log file; each process of a multi-process job has its own."""
  name = LOG_FILE if process_index == 0 else f"jax-ai-stack.process-{process_index}.log"
  return pathlib.Path(workdir) / name


def status(text: str, stream=None) -> None:
  """`text` on stderr for a person watching a terminal, at once (before slow imports).

  Where stderr is a file or a pipe (CI, SLURM, a script), nothing: there a
  failing command's output stays its one error line.
  """
  stream = stream if stream is not None else sys.stderr
  if stream.isatty():
    print(text, file=stream, flush=True)


def note(text: str) -> None:
  """`note: text` as a line of its own on stderr, for what a person should know that is not
  an error (stdout stays the command's result: `eval`'s JSON, `generate`'s text). What
  stdout holds is written first, so the note never runs onto a line of it in a terminal
  or a log both streams go to."""
  sys.stdout.flush()
  print(f"note: {text}", file=sys.stderr, flush=True)

