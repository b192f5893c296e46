"""Data mixtures with stages: which source feeds each row, as a pure function of the row.

A mixture names components (each a corpus of its own) and stages: from step
`step` on, weights over the components. The train stream's rows are dealt in
blocks of `BLOCK_ROWS`: within a block of a stage, each component gets its
share of the rows, rounded by largest remainder, so the weights hold exactly
to 1/BLOCK_ROWS over every block; and the block's rows are shuffled by a
stateless permutation of (seed, stage, block). The n-th row a component gets
is its stream position n, which its own endless, epoch-shuffled order turns
into an example (as `StepBatches` does for one corpus).

So row g's component and position come from integer arithmetic over the
stages before it and the one block it lies in: nothing to checkpoint beyond
the step, random access to any step, and each process computes only its own
rows. Stage boundaries are counted in steps (then in rows: step x global
batch), never in samples drawn, so a phase that starts at step S starts at
the same row however the run was stopped and resumed (Levanter's mixture
docstring warns about boundaries counted in samples). A block cut short by the
next stage is simply shorter: its rows are dealt from the same shuffled
pattern, so a component's rows are still consecutive stream positions.

Example: two components, 3:1, then 1:3 from row 8 (blocks of 4 rows here).
  >>> rows = MixtureRows(["code", "docs"], [(0, [3, 1]), (8, [1, 3])], seed=0, block_rows=4)
  >>> component, position = rows.assign(np.arange(12))
  >>> component.tolist()
  [1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1]
  >>> position.tolist()  # Each component's rows are its consecutive stream positions.
  [0, 0, 1, 2, 3, 4, 1, 5, 2, 3, 6, 4]
  >>> rows.rows_before(12).tolist()  # Rows each component has fed before row 12.
  [7, 5]
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from jax_ai_stack.recipes.data.permutation import permute

BLOCK_ROWS = 1024
"""Rows dealt together: each stage's weights hold exactly, to 1/BLOCK_ROWS, over each block."""


def block_counts(weights: Sequence[float], rows: int) -> np.ndarray:
  """Rows per component in a block of `rows`: `rows * weight / sum`, rounded by
  largest remainder (ties to the earlier component), summing to `rows`.

  Example:
    >>> block_counts([0.7, 0.3], 8).tolist(), block_counts([1, 1, 1], 4).tolist()
    ([6, 2], [2, 1, 1])
  """
  w = np.asarray(weights, dtype=np.float64)
  exact = rows * w / w.sum()
  counts = np.floor(exact).astype(np.int64)
  short = rows - int(counts.sum())
  order = np.argsort(-(exact - counts), kind="stable")  # Largest remainder first.
  counts[order[:short]] += 1
  return counts


class MixtureRows:
  """Row of the train stream -> (component, that component's stream position).

  Args:
    names: the components, in order (their index is the component id).
    stages: (first row, weights) per stage, the first at row 0, rows increasing.
    seed: the run's seed; the same seed deals the same rows.
    block_rows: rows dealt together (`BLOCK_ROWS`).
  """

  def __init__(self, names: Sequence[str], stages: Sequence[tuple[int, Sequence[float]]], *,
               seed: int, block_rows: int = BLOCK_ROWS):
    self.names = tuple(names)
    self.starts = np.array([start for start, _ in stages], dtype=np.int64)
    if self.starts[0] != 0 or np.any(np.diff(self.starts) <= 0):
      raise ValueError(f"stages must start at row 0 and increase, got {self.starts.tolist()}")
    self.block_rows = block_rows
    self.seed = seed
    self.counts = np.stack([block_counts(w, block_rows) for _, w in stages])
    # Rows each component fed before each stage: the stages are few, so summed once.
    before = [np.zeros(len(self.names), np.int64)]
    for stage in range(len(stages) - 1):
      length = int(self.starts[stage + 1] - self.starts[stage])
      before.append(before[-1] + self._rows_within(stage, length))
    self.before = np.stack(before)

  def _pattern(self, stage: int, block: int) -> np.ndarray:
    """Component of each row of one block: the stage's counts, shuffled by (seed, stage, block)."""
    dealt = np.repeat(np.arange(len(self.names)), self.counts[stage])
    stage_seed = int(zlib.crc32(f"{self.seed}/{stage}".encode()))
    return dealt[permute(np.arange(self.block_rows), self.block_rows, stage_seed, block)]

  def _rows_within(self, stage: int, length: int) -> np.ndarray:
    """Rows each component gets in the first `length` rows of `stage`."""
    blocks, rest = divmod(length, self.block_rows)
    partial = np.bincount(self._pattern(stage, blocks)[:rest], minlength=len(self.names))
    return blocks * self.counts[stage] + partial

  def rows_before(self, row: int) -> np.ndarray:
    """Rows each component has fed before stream row `row` (tokens seen, per component,
    are these x the tokens per row)."""
    stage = int(np.searchsorted(self.starts, row, side="right")) - 1
    return self.before[stage] + self._rows_within(stage, row - int(self.starts[stage]))

  def assign(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(component id, position in that component's stream) of each of `rows`."""
    rows = np.asarray(rows, dtype=np.int64)
    component = np.empty_like(rows)
    position = np.empty_like(rows)
    stage = np.searchsorted(self.starts, rows, side="right") - 1
    block, offset = np.divmod(rows - self.starts[stage], self.block_rows)
    for s, b in sorted(set(zip(stage.tolist(), block.tolist()))):
      here = (stage == s) & (block == b)
      pattern = self._pattern(s, b)
      # Rank of each row among the block's rows of its component: a running count.
      onehot = pattern[:, None] == np.arange(len(self.names))[None, :]
      rank = np.cumsum(onehot, axis=0) - 1
      c = pattern[offset[here]]
      component[here] = c
      position[here] = (self.before[s][c] + b * self.counts[s][c]
                        + rank[offset[here], c])
    return component, position

  def __repr__(self) -> str:
    stages = ", ".join(f"{int(start)}: {counts.tolist()}" for start, counts in
                       zip(self.starts, self.counts))
    return (f"MixtureRows({list(self.names)}, rows per {self.block_rows} from row "
            f"{{{stages}}}, seed={self.seed})")
