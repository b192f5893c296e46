"""Progress on stderr: tqdm's bar on a terminal, plain lines elsewhere (CI, SLURM, a pipe).

A bar redrawn into a file is kilobytes of carriage returns, so off a terminal
each update of the postfix writes one line, `UNIT N/TOTAL: TEXT, ETA 1m05s`.

Example:
  >>> lines = Lines("step", total=10, initial=0, file=sys.stdout)
  >>> lines.update(4)
  >>> lines.set_postfix_str("loss 2.000")  # doctest: +ELLIPSIS
  step 4/10: loss 2.000, ETA ...s
"""

from __future__ import annotations

import sys
import time


def bar(label: str, *, unit: str, total: int | None, initial: int = 0):
  """A bar named `label` counting `unit`s up to `total` (None: unknown) from
  `initial`: tqdm on a terminal, `Lines` elsewhere. Both take update,
  set_postfix_str, write and close."""
  if not sys.stderr.isatty():
    return Lines(unit, total=total, initial=initial)
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, desc=label, unit=unit, file=sys.stderr,
              mininterval=0.5, dynamic_ncols=True)


def say(progress, text: str) -> None:
  """`text` on its own line of stdout: above the bar `progress` (None: no bar, printed)."""
  if progress is not None:
    progress.write(text, file=sys.stdout)
  else:
    print(text, flush=True)


class Lines:
  """The bar's stand-in where stderr is no terminal: one line per postfix update."""

  def __init__(self, unit: str, *, total: int | None, initial: int, file=None):
    self.unit, self.n, self.total, self._initial = unit, initial, total, initial
    self._file = file
    self._started = time.perf_counter()

  def update(self, n: int) -> None:
    self.n += n

  def set_postfix_str(self, text: str) -> None:
    done, elapsed = self.n - self._initial, time.perf_counter() - self._started
    if self.total is None:
      position, eta = f"{self.n}", ""
    else:
      remaining = elapsed / done * (self.total - self.n) if done else 0.0
      position, eta = f"{self.n}/{self.total}", f", ETA {_duration(remaining)}"
    print(f"{self.unit} {position}: {text}{eta}", file=self._file or sys.stderr, flush=True)

  @staticmethod
  def write(text: str, file=None) -> None:
    print(text, file=file, flush=True)

  def close(self) -> None:
    pass


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(round(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
