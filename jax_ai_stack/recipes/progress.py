"""Progress on stderr: tqdm's bar on a terminal, plain lines elsewhere (CI, SLURM, a pipe).

A bar redrawn into a file is kilobytes of carriage returns, so off a terminal
each update of the postfix writes one line, `UNIT N/TOTAL: TEXT, ETA 1m05s`;
a bar with no postfix (bytes read, requests scored) writes one at each tenth,
`load 357MB/1.19GB (30%), ETA 12s`. Every bar the package draws is one of these.

Example:
  >>> lines = Lines("step", total=10, initial=0, file=sys.stdout)
  >>> lines.update(4)
  >>> lines.set_postfix_str("loss 2.000")  # doctest: +ELLIPSIS
  step 4/10: loss 2.000, ETA ...s
"""

from __future__ import annotations

import sys
import time


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


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(round(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
