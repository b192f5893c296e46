"""Shared by the data tests: reading batches from `build_dataset` and comparing them."""

from __future__ import annotations

import io

import numpy as np
import pytest

from jax_ai_stack.recipes.data import build_dataset

TEXTS = ["hello world, the quick brown fox", "jumps over the lazy dog"]
"""What the small tokenizer files are trained on."""


def read_batches(config, count=None, **kwargs) -> list[dict]:
  """`count` batches (None: all of a finite split); the iterator is closed after."""
  kwargs = {"split": "train", "seed": 0, "process_index": 0, "process_count": 1, **kwargs}
  iterator = iter(build_dataset(config, **kwargs))
  try:
    return list(iterator) if count is None else [next(iterator) for _ in range(count)]
  finally:
    iterator.close()


def assert_same_batches(batches_a, batches_b) -> None:
  """Bitwise: the same keys, dtypes and values, batch by batch."""
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for key in a:
      assert a[key].dtype == b[key].dtype, key
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def hf_tokenizer_file(tmp_path, special_tokens=("<unk>", "<s>", "</s>", "<pad>")) -> str:
  """A byte-level BPE tokenizer.json of 300 tokens trained on TEXTS, in `tmp_path`."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
  )
  tok.train_from_iterator(TEXTS * 10, trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return str(path)


def sentencepiece_file(tmp_path, **options) -> str:
  """A SentencePiece character model of 30 pieces trained on TEXTS, in `tmp_path`."""
  spm = pytest.importorskip("sentencepiece")
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXTS * 20), model_writer=model, vocab_size=30,
      model_type="char", minloglevel=2, **options,
  )
  path = tmp_path / "sp.model"
  path.write_bytes(model.getvalue())
  return str(path)
