"""Windows and packing: exact layout, against Grain's own packer, bad sizes."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from jax_ai_stack.recipes.data import LMPacked, LMWindows, TokenCorpus, examples

BOS, EOS, PAD = 256, 257, 258


def _corpus(documents: list[np.ndarray]) -> TokenCorpus:
  starts = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
  return TokenCorpus(np.concatenate(documents).astype(np.uint16), starts, "test")


def _random_documents(count: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [
      np.concatenate([[BOS], rng.integers(0, 256, rng.integers(0, 40)), [EOS]])
      for _ in range(count)
  ]


def test_windows_are_slices_of_the_stream():
  corpus = _corpus(_random_documents(30))
  seq_len = 8
  windows = LMWindows(corpus, seq_len)
  assert windows.num_examples == (corpus.num_tokens - 1) // seq_len
  ids = np.array([0, 3, windows.num_examples - 1])
  batch = windows(ids)
  for row, i in enumerate(ids):
    expected = corpus.tokens[i * seq_len:i * seq_len + seq_len + 1]
    np.testing.assert_array_equal(batch["inputs"][row], expected[:-1])
    np.testing.assert_array_equal(batch["targets"][row], expected[1:])
  np.testing.assert_array_equal(batch["segment_ids"], np.ones((3, seq_len)))
  np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(seq_len), (3, 1)))
  np.testing.assert_array_equal(batch["loss_mask"], np.ones((3, seq_len)))
  assert {v.dtype for k, v in batch.items() if k != "loss_mask"} == {np.dtype(np.int32)}
  assert batch["loss_mask"].dtype == np.float32


def test_packing_matches_grains_concat_then_split():
  documents = _random_documents(50, seed=1)
  seq_len = 16
  packed = LMPacked(_corpus(documents), seq_len, pad_id=PAD)
  mine = packed(np.arange(packed.num_examples))
  reference = grain.MapDataset.source(
      [{"inputs": d[:-1].astype(np.int32), "targets": d[1:].astype(np.int32)} for d in documents]
  ).to_iter_dataset()
  reference = list(grain.experimental.ConcatThenSplitIterDataset(
      reference,
      length_struct={"inputs": seq_len, "targets": seq_len},
      split_full_length_features=True,
  ))
  assert len(reference) == packed.num_examples
  stack = lambda key: np.stack([row[key] for row in reference])
  np.testing.assert_array_equal(mine["segment_ids"], stack("inputs_segment_ids"))
  np.testing.assert_array_equal(mine["positions"], stack("inputs_positions"))
  real = mine["loss_mask"] > 0
  np.testing.assert_array_equal(mine["inputs"][real], stack("inputs")[real])
  np.testing.assert_array_equal(mine["targets"][real], stack("targets")[real])


def test_packing_segments_never_mix_documents():
  # Document k is [BOS, k, k, ..., EOS], so every token names its document.
  rng = np.random.default_rng(2)
  documents = [np.array([BOS] + [k] * int(rng.integers(1, 12)) + [EOS]) for k in range(40)]
  seq_len = 10
  packed = LMPacked(_corpus(documents), seq_len, pad_id=PAD)
  batch = packed(np.arange(packed.num_examples))
  seen = set()
  for row in range(packed.num_examples):
    segments = batch["segment_ids"][row]
    for segment in np.unique(segments[segments > 0]):
      where = segments == segment
      content = {int(t) for t in batch["inputs"][row][where]} - {BOS, EOS}
      content |= {int(t) for t in batch["targets"][row][where]} - {BOS, EOS}
      assert len(content) == 1, (row, segment, content)  # one document per segment
      seen |= content
      positions = batch["positions"][row][where]
      np.testing.assert_array_equal(positions, np.arange(where.sum()))
      assert np.all(np.diff(np.flatnonzero(where)) == 1)  # contiguous
    # Segment ids count 1, 2, ... from the row's start.
    real = segments[segments > 0]
    np.testing.assert_array_equal(np.unique(real), np.arange(1, real.max() + 1))
  assert seen == set(range(40))
  np.testing.assert_array_equal(batch["loss_mask"], batch["segment_ids"] > 0)
  # Only the last row is padded, with PAD and segment id 0.
  padded_rows = np.flatnonzero((batch["segment_ids"] == 0).any(axis=1))
  assert set(padded_rows) <= {packed.num_examples - 1}
  pad = batch["segment_ids"] == 0
  assert np.all(batch["inputs"][pad] == PAD) and np.all(batch["positions"][pad] == 0)


def test_packed_targets_are_next_tokens_of_the_same_document():
  documents = _random_documents(20, seed=3)
  packed = LMPacked(_corpus(documents), 12, pad_id=PAD)
  batch = packed(np.arange(packed.num_examples))
  real = batch["loss_mask"] > 0
  pairs = np.stack([batch["inputs"][real], batch["targets"][real]], axis=1)
  expected = np.concatenate([np.stack([d[:-1], d[1:]], axis=1) for d in documents])
  np.testing.assert_array_equal(pairs, expected)
  assert not np.any(batch["inputs"][real] == EOS)  # EOS only ever is a target


@pytest.mark.parametrize("builder", [LMWindows, lambda c, t: LMPacked(c, t, PAD)])
def test_seq_len_longer_than_the_data_is_an_error(builder):
  corpus = _corpus([np.array([BOS, 1, 2, 3, EOS])])
  with pytest.raises(ValueError, match=r"seq_len=5 is longer than the data.*holds 5 tokens"):
    builder(corpus, 5)
  assert builder(corpus, 4).num_examples == 1


def test_one_per_row_keeps_each_sequence_whole_and_pads_the_rest():
  rows = examples.one_per_row([(np.array([5, 6, 7]), np.array([0.0, 0.0, 1.0])),
                               (np.array([8, 9]), np.array([0.0, 1.0]))], seq_len=4, pad_id=0)
  assert rows["inputs"].tolist() == [[5, 6, 0, 0], [8, 0, 0, 0]]
  assert rows["targets"].tolist() == [[6, 7, 0, 0], [9, 0, 0, 0]]
  assert rows["segment_ids"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
  assert rows["positions"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]
  assert rows["loss_mask"].tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
