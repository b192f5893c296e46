"""How scoring requests are laid out: packed rows first fit and longest first, each request
its own segment; contexts shared in whole pages; batches of groups bounded; widths few."""

import numpy as np

from jax_ai_stack.recipes.evaluation.rows import (SHARED_PAGE, SHARED_ROWS, Packed,
                                                  group_batches, pack, row_width,
                                                  shared_contexts, shared_length)


def test_requests_fill_rows_longest_first_each_where_it_first_fits():
  assert pack([5, 3, 8, 2], 8) == [[2], [0, 1], [3]]
  assert pack([4, 4, 4], 16) == [[0, 1, 2]]
  assert pack([4, 4], 0) == [[0], [1]]  # Width 0: one per row.


def test_a_packed_row_gives_each_sequence_its_segment_and_positions():
  batch = Packed(2, 8)
  assert batch.add(0, [1, 2, 3]) == 2 and batch.add(0, [4, 5, 6, 7]) == 5
  inputs, targets, segment_ids, positions = batch.arrays()
  assert inputs[0].tolist() == [1, 2, 4, 5, 6, 0, 0, 0]
  assert targets[0].tolist() == [2, 3, 5, 6, 7, 0, 0, 0]
  assert segment_ids[0].tolist() == [1, 1, 2, 2, 2, 0, 0, 0]
  assert positions[0].tolist() == [0, 1, 0, 1, 2, 0, 0, 0]
  assert not inputs[1].any()


def test_a_context_is_shared_in_whole_pages_before_its_last_token():
  context = list(range(1, 2 * SHARED_PAGE + 2))  # Two pages and two tokens.
  assert shared_length(context + [7], 1) == 2 * SHARED_PAGE
  assert shared_length(context[:SHARED_PAGE] + [7], 1) == 0  # Its last token is its own.
  assert shared_contexts([context + [7], context + [8], [9] * 80], [1, 1, 1]) == [[0, 1]]


def test_batches_of_groups_hold_at_most_batch_size_groups_and_their_share_of_requests():
  groups = [[0, 1], [2, 3, 4], [5], list(range(6, 6 + 3 * SHARED_ROWS))]
  batches = list(group_batches(groups, 2))
  assert batches == [groups[:2], [groups[2]], [groups[3]]]
  assert [i for batch in batches for group in batch for i in group] == list(range(18))


def test_widths_are_few_and_pad_at_most_a_third_within_their_bounds():
  widths = [row_width(n, 512) for n in range(1, 600)]
  assert sorted(set(widths)) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
  assert all(2 * w <= 3 * n for n, w in enumerate(widths, 1) if 16 < n <= 512)
  assert row_width(3, 64, least=32) == 32
  assert np.all(np.diff(widths) >= 0)
