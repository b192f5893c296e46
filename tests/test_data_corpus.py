"""The train/validation split by chunk: one text file gives both splits."""

from __future__ import annotations

import numpy as np
import pytest

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import DataConfig, build_dataset, load_corpus
from jax_ai_stack.recipes.data.corpus import held_out_chunks, split_document

BOS, EOS = 256, 257


def _one_file(tmp_path, size: int, **fields) -> DataConfig:
  words = np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta", "\n"], size)
  text = " ".join(words)[:size]
  (tmp_path / "notes.txt").write_text(text, encoding="utf-8")
  fields = {"source": "text", "paths": (str(tmp_path / "notes.txt"),), "seq_len": 16,
            "batch_size": 4, "validation_fraction": 0.2, "split_chunk_tokens": 256, **fields}
  return DataConfig(**fields)


def test_one_text_file_builds_both_splits(tmp_path):
  config = _one_file(tmp_path, 6000)
  splits = load_corpus(config)
  train, validation = splits["train"], splits["validation"]
  assert train.num_tokens + validation.num_tokens == 6000 + 2  # + BOS, EOS
  # A chunk of 256 tokens is held out with probability 0.2: 24 chunks, a few of each.
  assert 0.05 < validation.num_tokens / 6002 < 0.4
  # The pieces are the file's chunks, in file order, each side keeping its own.
  file_tokens = np.concatenate([[BOS], np.frombuffer((tmp_path / "notes.txt").read_bytes(),
                                                     np.uint8), [EOS]])
  held_out = held_out_chunks((tmp_path / "notes.txt").read_bytes(), 6002, 256, 0.2)
  chunks = np.split(file_tokens, np.arange(256, 6002, 256))
  np.testing.assert_array_equal(
      validation.tokens, np.concatenate([c for c, h in zip(chunks, held_out) if h]))
  np.testing.assert_array_equal(
      train.tokens, np.concatenate([c for c, h in zip(chunks, held_out) if not h]))
  for split in ("train", "validation"):
    batch = next(iter(build_dataset(config, split=split, seed=0, process_index=0,
                                    process_count=1)))
    assert batch["inputs"].shape == (4, 16)


def test_consecutive_chunks_on_one_side_stay_one_piece():
  ids = np.arange(1000)
  pieces = list(split_document(b"some document", ids, 100, 0.5))
  held_out = held_out_chunks(b"some document", 1000, 100, 0.5)
  runs = 1 + int(np.sum(held_out[1:] != held_out[:-1]))
  assert len(pieces) == runs and runs > 1
  assert [side for side, _ in pieces] == [bool(h) for h in held_out[np.r_[
      0, np.flatnonzero(held_out[1:] != held_out[:-1]) + 1]]]
  np.testing.assert_array_equal(np.concatenate([p for _, p in pieces]), ids)


def test_the_side_of_a_chunk_depends_on_its_document_and_position_only():
  first = held_out_chunks(b"a document", 5000, 100, 0.3)
  assert first.tolist() == held_out_chunks(b"a document", 5000, 100, 0.3).tolist()
  assert first[:20].tolist() == held_out_chunks(b"a document", 2000, 100, 0.3).tolist()
  assert first.tolist() != held_out_chunks(b"another document", 5000, 100, 0.3).tolist()
  assert not held_out_chunks(b"a document", 5000, 100, 0.0).any()
  assert 0.2 < first.mean() < 0.4


def test_a_tiny_file_says_how_many_tokens_a_batch_needs(tmp_path):
  config = _one_file(tmp_path, 160, split_chunk_tokens=32, validation_fraction=0.3)
  tokens = load_corpus(config)["validation"].num_tokens
  assert 0 < tokens < 65
  message = (rf"data: the validation split has {tokens} tokens; one global batch needs at"
             r" least data\.batch_size x data\.seq_len \+ 1 = 4 x 16 \+ 1 = 65: raise"
             r" data\.validation_fraction \(now 0\.3\), lower data\.batch_size or data\.seq_len,"
             r" or add documents \(source='text' paths=\[.*notes\.txt'\], split='validation'\)")
  with pytest.raises(DataError, match=message):
    build_dataset(config, split="validation", seed=0, process_index=0, process_count=1)


def test_a_file_shorter_than_a_chunk_moves_whole(tmp_path):
  # The default chunk (512 tokens) is longer than the file: one side, whole.
  config = _one_file(tmp_path, 300, split_chunk_tokens=512)
  splits = load_corpus(config)
  assert sorted(s.num_documents for s in splits.values()) == [0, 1]


def test_the_chunk_size_is_part_of_the_cache_key(tmp_path):
  small = load_corpus(_one_file(tmp_path, 6000, split_chunk_tokens=64))
  large = load_corpus(_one_file(tmp_path, 6000, split_chunk_tokens=4096))
  assert small["train"].num_documents > 1
  assert large["train"].num_documents + large["validation"].num_documents == 1
