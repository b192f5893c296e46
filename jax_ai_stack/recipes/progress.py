"""Progress on stderr: tqdm's bar on a terminal, plain lines elsewhere (CI, SLURM, a pipe).

A bar redrawn into a file is kilobytes of carriage returns, so off a terminal
each update of the postfix writes one line, `UNIT N/TOTAL: TEXT, ETA 1m05s`;
a bar with no postfix (bytes read, requests scored) writes one at each tenth,
`load 357MB/1.19GB (30%), ETA 12s`. Every bar the package draws is one of these.

A wait with no bar (building a model, tracing, compiling, sampling) is a `Wait`:
its line once it has lasted `QUIET_S` seconds, then the time it has taken every
`EVERY_S` seconds while nothing else was said, so that no phase is silent for
long; quick phases say nothing.

Example:
  >>> lines = Lines("step", total=10, initial=0, file=sys.stdout)
  >>> lines.update(4)
  >>> lines.set_postfix_str("loss 2.000")  # doctest: +ELLIPSIS
  step 4/10: loss 2.000, ETA ...s
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

QUIET_S = 5.0
"""A `Wait` shorter than this says nothing (most programs compile in less)."""
EVERY_S = 15.0
"""A `Wait` still open says so this often while no other line of a wait was written."""
_TICK_S = 0.5


def bar(label: str, *, unit: str, total: int | None, initial: int = 0,
        tenths: bool = False, unit_scale: bool = False, disable: bool = False):
  """A bar named `label` counting `unit`s up to `total` (None: unknown) from
  `initial`: tqdm on a terminal, `Lines` elsewhere. Both take update,
  set_postfix_str, write and close, and work as a context manager.

  `tenths`: off a terminal, a line at each tenth of `total` (for a bar whose
  postfix is never set). `unit_scale`: amounts as 1.19G (bytes). `disable`:
  nothing drawn anywhere.
  """
  if disable or not sys.stderr.isatty():
    return Lines(unit, total=total, initial=initial, label=label if tenths else None,
                 unit_scale=unit_scale, quiet=disable)
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, desc=label, unit=unit, file=sys.stderr,
              mininterval=0.5, dynamic_ncols=True, unit_scale=unit_scale)


def say(progress, text: str) -> None:
  """`text` on its own line of stdout: above the bar `progress` (None: no bar, printed)."""
  if progress is not None:
    progress.write(text, file=sys.stdout)
  else:
    print(text, flush=True)


class Lines:
  """The bar's stand-in where stderr is no terminal: one line per postfix update, or
  (`label` given) one at each tenth of `total` that `update` reaches."""

  def __init__(self, unit: str, *, total: int | None, initial: int, file=None,
               label: str | None = None, unit_scale: bool = False, quiet: bool = False):
    self.unit, self.n, self.total, self._initial = unit, initial, total, initial
    self._file, self._label, self._scale, self._quiet = file, label, unit_scale, quiet
    self._started = time.perf_counter()
    self._tenth = self._tenths_done()

  def update(self, n: int) -> None:
    self.n += n
    if self._label is None or self._tenths_done() == self._tenth:
      return
    self._tenth = self._tenths_done()
    self._print(f"{self._label} {self._amount(self.n)}/{self._amount(self.total)}"
                f"{'' if self._scale else ' ' + self.unit} ({100 * self.n // self.total}%)"
                f"{self._eta()}")

  def set_postfix_str(self, text: str) -> None:
    position = f"{self.n}" if self.total is None else f"{self.n}/{self.total}"
    self._print(f"{self.unit} {position}: {text}{self._eta()}")

  def _tenths_done(self) -> int:
    return 10 * self.n // self.total if self.total else 0

  def _amount(self, n: int) -> str:
    if not self._scale:
      return f"{n:,}"
    from tqdm import tqdm

    return tqdm.format_sizeof(n, suffix=self.unit)

  def _eta(self) -> str:
    if self.total is None:
      return ""
    done, elapsed = self.n - self._initial, time.perf_counter() - self._started
    remaining = elapsed / done * (self.total - self.n) if done else 0.0
    return f", ETA {_duration(remaining)}"

  def _print(self, text: str) -> None:
    if not self._quiet:
      print(text, file=self._file or sys.stderr, flush=True)

  def __enter__(self) -> Lines:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @staticmethod
  def write(text: str, file=None) -> None:
    print(text, file=file, flush=True)

  def close(self) -> None:
    pass


class Wait:
  """A phase the user waits on without a bar: `TEXT ...` on stderr once it has lasted
  `first` seconds (default `QUIET_S`; 0: at once), then `TEXT ... 35 s` every `EVERY_S`
  seconds while no other wait wrote a line (the newest open wait speaks); `close(done)`
  writes `done` only where a line was written, so that a quick phase stays silent.
  `said`: the caller has written TEXT already; only the heartbeat follows. Plain lines
  everywhere (above tqdm's bar on a terminal), from one background thread that the
  open waits share."""

  def __init__(self, text: str, *, first: float | None = None, said: bool = False):
    self.text, self.said = text, said
    self.started = time.perf_counter()
    self._first = QUIET_S if first is None else first
    with _LOCK:
      _OPEN.append(self)
      if said:
        _LAST[0] = self.started
      elif self._first == 0:
        self._say(f"{text} ...")
    _ensure_ticker()

  @property
  def elapsed_s(self) -> float:
    return time.perf_counter() - self.started

  def close(self, done: str | None = None) -> None:
    """Ends the wait; `done` (its outcome) is written if the wait said anything."""
    with _LOCK:
      if self in _OPEN:
        _OPEN.remove(self)
      if done and self.said:
        self._say(done)

  def _due(self, now: float) -> str | None:
    """The line the ticker should write for this wait now, or None."""
    if not self.said:
      return f"{self.text} ..." if now - self.started >= self._first else None
    if now - _LAST[0] >= EVERY_S:
      return f"{self.text} ... {now - self.started:.0f} s"
    return None

  def _say(self, line: str) -> None:
    """Writes `line` (the caller holds `_LOCK`)."""
    self.said = True
    _LAST[0] = time.perf_counter()
    stream = sys.stderr
    if stream.isatty():  # Above the bar, if one is drawn.
      from tqdm import tqdm

      tqdm.write(line, file=stream)
    else:
      print(line, file=stream, flush=True)


_LOCK = threading.Lock()
_OPEN: list[Wait] = []
"""The open waits, oldest first (console pacing, not program state)."""
_LAST = [0.0]
"""When a wait last wrote a line."""
_TICKER: list[threading.Thread] = []


def _ensure_ticker() -> None:
  with _LOCK:
    if _TICKER:
      return
    thread = threading.Thread(target=_tick, name="jax-ai-stack waits", daemon=True)
    _TICKER.append(thread)
  thread.start()


def _tick() -> None:
  """Writes the newest wait's due line every `_TICK_S`; ends when no wait is open."""
  while True:
    time.sleep(_TICK_S)
    with _LOCK:
      if not _OPEN:
        _TICKER.clear()
        return
      now = time.perf_counter()
      for wait in reversed(_OPEN):
        if (line := wait._due(now)) is not None:  # pylint: disable=protected-access
          wait._say(line)  # pylint: disable=protected-access
          break


@contextlib.contextmanager
def waiting(text: str, *, first: float | None = None, said: bool = False,
            done=None) -> Iterator[Wait]:
  """A `Wait` for the block; `done`: a function of the wait giving its closing line
  (not called where the block raised)."""
  wait = Wait(text, first=first, said=said)
  ok = False
  try:
    yield wait
    ok = True
  finally:
    wait.close(done(wait) if ok and done is not None else None)


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(round(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
