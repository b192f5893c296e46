"""A batch size that changes at named steps, and where each step's rows start.

`data.batch_size` rows per step until the first entry of `data.batch_schedule`,
then each entry's size from its step on. The train stream's rows are dealt in
order, so step s covers rows [first_row(s), first_row(s) + size(s)): integer
arithmetic over the entries before s. A run resumed at any step, on any number
of processes, reads on from the same row without saving anything beyond the
step, and a mixture's stage boundaries (counted in steps) land on the same rows
whatever the batch sizes before them.

Example: 4 rows per step, 8 from step 3 on, 2 from step 5 on.
  >>> schedule = BatchSchedule([0, 3, 5], [4, 8, 2])
  >>> [schedule.size(s) for s in range(7)]
  [4, 4, 4, 8, 8, 2, 2]
  >>> [schedule.first_row(s) for s in range(7)]
  [0, 4, 8, 12, 20, 28, 30]
  >>> BatchSchedule.constant(8).first_row(10)
  80
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
  """Global rows per step: `sizes[i]` from step `starts[i]` on (`starts[0]` is 0)."""

  starts: tuple[int, ...]
  sizes: tuple[int, ...]

  def __init__(self, starts: Sequence[int], sizes: Sequence[int]):
    starts, sizes = tuple(int(s) for s in starts), tuple(int(n) for n in sizes)
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
      raise ValueError(f"a batch schedule starts at step 0 and its steps increase, got {starts}")
    if len(sizes) != len(starts) or min(sizes) < 1:
      raise ValueError(f"one size >= 1 per start, got starts {starts} and sizes {sizes}")
    object.__setattr__(self, "starts", starts)
    object.__setattr__(self, "sizes", sizes)

  @classmethod
  def constant(cls, size: int) -> BatchSchedule:
    return cls([0], [size])

  @classmethod
  def of(cls, config) -> BatchSchedule:
    """A `DataConfig`'s schedule: `batch_size`, then each `batch_schedule` entry."""
    entries = [(0, config.batch_size)] + [(e.step, e.batch_size) for e in config.batch_schedule]
    return cls([step for step, _ in entries], [size for _, size in entries])

  def _entry(self, step: int) -> int:
    return bisect.bisect_right(self.starts, step) - 1

  def size(self, step: int) -> int:
    """Global rows of step `step` (0-based: the step that the logs number step + 1)."""
    return self.sizes[self._entry(step)]

  def first_row(self, step: int) -> int:
    """Rows of the train stream the steps before `step` read."""
    i = self._entry(step)
    before = sum((b - a) * n for a, b, n in zip(self.starts, self.starts[1:i + 1], self.sizes))
    return before + (step - self.starts[i]) * self.sizes[i]

  def __repr__(self) -> str:
    return "BatchSchedule({" + ", ".join(f"{a}: {n}" for a, n in zip(self.starts, self.sizes)) + "})"
