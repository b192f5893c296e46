"""Examples addressed by index, built a whole batch at a time with NumPy.

Each class here holds one split in memory and maps an int array of example
ids to a batch dict. No per-example Python runs, so building a batch costs a
few gathers whatever the batch size, and an example is a pure function of its
id: shuffling, sharding and checkpointing then only deal with integers.

LM batches are `{"inputs", "targets", "segment_ids", "positions"}` int32
[B, T] plus `"loss_mask"` float32 [B, T]:

* `LMWindows`: example i is the window `tokens[i*T : i*T + T + 1]` of the
  split's concatenated stream (inputs = its first T tokens, targets = its last
  T). Windows ignore document boundaries: segment_ids are all 1, positions
  0..T-1, loss_mask all 1.
* `one_per_row`: sequences that each keep a row of their own (preference
  pairs, a rollout's completions), the rest of the row padding.
* `LMPacked`: concat-then-split packing, the layout of Grain's
  `ConcatThenSplitIterDataset` (with `split_full_length_features=True`), made
  index-addressable. Each document `[BOS, ..., EOS]` contributes its
  (token, next token) pairs; the pairs of all documents are laid end to end and
  cut into rows of T. A document that does not fit continues in the next row.
  Within a row, segment ids are 1, 2, ... per document piece and positions
  restart at 0 in each piece; only the last row has padding (segment id 0,
  PAD tokens, loss_mask 0). Every non-padding target is the next token of the
  same document, so `loss_mask == (segment_ids > 0)`; attending only within a
  segment never crosses a document. Trade-off: rows are fixed once (documents
  in corpus order) and only the row order is reshuffled each epoch.

Example: two documents (BOS 256, EOS 257) as windows and packed (PAD 258).
  >>> corpus = TokenCorpus(np.array([256, 10, 11, 12, 257, 256, 20, 21, 257]),
  ...                      doc_starts=np.array([0, 5, 9]), description="two documents")
  >>> windows = LMWindows(corpus, seq_len=4)
  >>> batch = windows(np.arange(windows.num_examples))
  >>> batch["inputs"].tolist(), batch["targets"].tolist()
  ([[256, 10, 11, 12], [257, 256, 20, 21]], [[10, 11, 12, 257], [256, 20, 21, 257]])
  >>> packed = LMPacked(corpus, seq_len=4, pad_id=258)
  >>> batch = packed(np.arange(packed.num_examples))
  >>> batch["inputs"].tolist(), batch["targets"].tolist()
  ([[256, 10, 11, 12], [256, 20, 21, 258]], [[10, 11, 12, 257], [20, 21, 257, 258]])
  >>> batch["segment_ids"].tolist(), batch["loss_mask"].tolist()
  ([[1, 1, 1, 1], [1, 1, 1, 0]], [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data.corpus import TokenCorpus


def one_per_row(sequences: Sequence[tuple[np.ndarray, np.ndarray]], *, seq_len: int,
                pad_id: int) -> dict[str, np.ndarray]:
  """(token ids, mask) pairs of at most `seq_len + 1` tokens, one to a row (not packed): the
  LM batch keys [len(sequences), seq_len], `loss_mask` the mask of each target token (1: its
  prediction counts), the rest of a row padding (segment 0, PAD, no loss)."""
  shape = (len(sequences), seq_len)
  arrays = {"inputs": np.full(shape, pad_id, np.int32), "targets": np.full(shape, pad_id, np.int32),
            "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32)}
  for row, (ids, mask) in enumerate(sequences):
    n = len(ids) - 1
    arrays["inputs"][row, :n], arrays["targets"][row, :n] = ids[:-1], ids[1:]
    arrays["segment_ids"][row, :n] = 1
    arrays["positions"][row, :n] = np.arange(n)
    arrays["loss_mask"][row, :n] = mask[1:]
  return arrays


def _too_short(corpus: TokenCorpus, seq_len: int) -> DataError:
  return DataError(
      f"data.seq_len={seq_len} is longer than the data: {corpus!r} holds"
      f" {corpus.num_tokens} tokens and an example needs seq_len + 1 ="
      f" {seq_len + 1}; lower data.seq_len or add documents"
  )


class LMWindows:
  """Fixed windows of seq_len + 1 tokens over the concatenated stream."""

  def __init__(self, corpus: TokenCorpus, seq_len: int):
    if corpus.num_tokens < seq_len + 1:
      raise _too_short(corpus, seq_len)
    self.corpus = corpus
    self.seq_len = seq_len
    self.num_examples = (corpus.num_tokens - 1) // seq_len
    self._offsets = np.arange(seq_len + 1)

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    windows = self.corpus.tokens[ids[:, None] * self.seq_len + self._offsets].astype(np.int32)
    shape = (len(ids), self.seq_len)
    return {
        "inputs": windows[:, :-1],
        "targets": windows[:, 1:],
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), shape).copy(),
        "loss_mask": np.ones(shape, np.float32),
    }

  def __repr__(self) -> str:
    return f"LMWindows({self.corpus!r}, seq_len={self.seq_len})"


class LMPacked:
  """Documents packed end to end into rows of seq_len (inputs, target) pairs."""

  def __init__(self, corpus: TokenCorpus, seq_len: int, pad_id: int):
    if corpus.num_tokens < seq_len + 1:
      raise _too_short(corpus, seq_len)
    self.corpus = corpus
    self.seq_len = seq_len
    self.pad_id = pad_id
    lengths = np.diff(corpus.doc_starts)
    keep = lengths >= 2  # a one-token document has no (token, next token) pair
    self._doc_starts = corpus.doc_starts[:-1][keep]
    self._pair_starts = np.concatenate([[0], np.cumsum(lengths[keep] - 1)])
    self.num_pairs = int(self._pair_starts[-1])
    self.num_examples = -(-self.num_pairs // seq_len)
    self._offsets = np.arange(seq_len)

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    row_starts = ids[:, None] * self.seq_len
    pairs = row_starts + self._offsets  # [B, T] indices into the pair stream
    real = pairs < self.num_pairs
    pairs = np.minimum(pairs, self.num_pairs - 1)
    docs = np.searchsorted(self._pair_starts, pairs, side="right") - 1
    doc_pair_starts = self._pair_starts[docs]
    tokens_at = self._doc_starts[docs] + (pairs - doc_pair_starts)
    piece_starts = np.maximum(doc_pair_starts, row_starts)
    return {
        "inputs": np.where(real, self.corpus.tokens[tokens_at], self.pad_id).astype(np.int32),
        "targets": np.where(real, self.corpus.tokens[tokens_at + 1], self.pad_id).astype(np.int32),
        "segment_ids": np.where(real, docs - docs[:, :1] + 1, 0).astype(np.int32),
        "positions": np.where(real, pairs - piece_starts, 0).astype(np.int32),
        "loss_mask": real.astype(np.float32),
    }

  def __repr__(self) -> str:
    return f"LMPacked({self.corpus!r}, seq_len={self.seq_len})"


class DigitsExamples:
  """scikit-learn digits: `{"images": float32 [B, 8, 8, 1], "labels": int32 [B]}`."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, split: str):
    self.images = images
    self.labels = labels
    self.split = split
    self.num_examples = len(labels)

  def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"images": self.images[ids], "labels": self.labels[ids]}

  def __repr__(self) -> str:
    return f"DigitsExamples(split={self.split!r}, examples={self.num_examples})"
