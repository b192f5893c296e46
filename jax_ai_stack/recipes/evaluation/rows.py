"""How `HarnessModel` lays scoring requests out in rows: packed several to a row (`pack`,
`Packed`: each its own segment, as training packs documents), grouped by a shared context
whose pages are prefilled once (`shared_contexts`, `group_batches`), and as wide as a
half octave of the longest (`row_width`), so that a few compiled programs serve every
call. Plain numpy: nothing here runs the model.

Example: first fit, longest first.
  >>> pack([5, 9, 3, 4], width=12)
  [[1, 2], [0, 3]]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from jax_ai_stack.recipes.inference.programs import half_octave

__all__ = ["MIN_WIDTH", "Packed", "SHARED_PAGE", "SHARED_ROWS", "group_batches", "pack",
           "row_width", "shared_contexts", "shared_length", "whole_pages"]

MIN_WIDTH = 16
"""The narrowest batch `row_width` makes (the engine's smallest padded prompt too)."""
SHARED_PAGE = 32
"""Positions per page of a shared context's keys and values (a request's own tokens start
at a page, so up to this many - 1 of its context's tokens are its own)."""
SHARED_ROWS = 4
"""The requests scored at once after shared contexts: this many per `batch_size` row (a
multiple-choice question's choices are short, its context long)."""


def row_width(size: int, limit: int, least: int = MIN_WIDTH) -> int:
  """`size` positions rounded up to 16, 24, 32, 48, 64, 96, ... (two steps an octave, at
  most a third of padding; at least `least`), at most `limit`: few compiled programs,
  little padding.

  Example:
    >>> [row_width(n, 512) for n in (5, 17, 25, 90, 100, 400, 600)]
    [16, 24, 32, 96, 128, 512, 512]
  """
  return min(max(least, half_octave(size)), limit)


def shared_length(sequence: Sequence[int], count: int) -> int:
  """The positions of a request's context that it can share: whole `SHARED_PAGE`s, before
  the context's last token (whose logits score the continuation's first)."""
  return max(len(sequence) - count - 1, 0) // SHARED_PAGE * SHARED_PAGE


def shared_contexts(sequences: Sequence[Sequence[int]], counts: Sequence[int]
                    ) -> list[list[int]]:
  """Groups of two or more requests (indices) whose sequences begin with the same shared
  context (`shared_length`), longest context first.

  Example: three choices after one context of 40 tokens, and a request of its own.
    >>> context = list(range(1, 41))
    >>> shared_contexts([context + [7], context + [8, 9], context + [3], [5] * 30], [1, 2, 1, 1])
    [[0, 1, 2]]
  """
  groups: dict[tuple[int, ...], list[int]] = {}
  for index, (sequence, count) in enumerate(zip(sequences, counts)):
    if length := shared_length(sequence, count):
      groups.setdefault(tuple(sequence[:length]), []).append(index)
  return sorted((g for g in groups.values() if len(g) > 1),
                key=lambda g: -shared_length(sequences[g[0]], counts[g[0]]))


def group_batches(groups: list[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
  """Up to `batch_size` groups at a time, and about `SHARED_ROWS` x `batch_size` of their
  requests (a group larger than that alone)."""
  batch: list[list[int]] = []
  for group in groups:
    if batch and (len(batch) == batch_size
                  or sum(map(len, batch)) + len(group) > SHARED_ROWS * batch_size):
      yield batch
      batch = []
    batch.append(group)
  if batch:
    yield batch


def whole_pages(size: int) -> int:
  """`size` positions rounded up to whole `SHARED_PAGE`s."""
  return -(-size // SHARED_PAGE) * SHARED_PAGE


def pack(lengths: Sequence[int], width: int) -> list[list[int]]:
  """Rows of at most `width` positions holding sequences of `lengths`: first fit, longest
  first; each row lists its sequences' indices (a width below a length: one per row)."""
  rows: list[list[int]] = []
  room: list[int] = []
  for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
    if row == len(rows):
      rows.append([])
      room.append(width)
    rows[row].append(index)
    room[row] -= lengths[index]
  return rows


class Packed:
  """One batch of packed rows being filled: inputs, targets, segment ids and positions."""

  def __init__(self, batch_size: int, width: int):
    self.inputs = np.zeros((batch_size, width), np.int32)
    self.targets = np.zeros_like(self.inputs)
    self.segment_ids = np.zeros_like(self.inputs)
    self.positions = np.zeros_like(self.inputs)
    self._used = [0] * batch_size

  def add(self, row: int, sequence: list[int]) -> int:
    """Puts `sequence` (inputs its tokens but the last, targets but the first) in `row` as
    its next segment; the position after its last."""
    first = self._used[row]
    end = first + len(sequence) - 1
    self.inputs[row, first:end], self.targets[row, first:end] = sequence[:-1], sequence[1:]
    self.segment_ids[row, first:end] = self.segment_ids[row, :first].max(initial=0) + 1
    self.positions[row, first:end] = np.arange(end - first)
    self._used[row] = end
    return end

  def arrays(self) -> tuple[np.ndarray, ...]:
    return self.inputs, self.targets, self.segment_ids, self.positions
