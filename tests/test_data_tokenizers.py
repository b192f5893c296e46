"""Byte, Hugging Face and SentencePiece tokenizers behind one interface."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from data_helpers import TEXTS, hf_tokenizer_file, sentencepiece_file

from jax_ai_stack.errors import ConfigError, DataError, MissingExtraError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.data import (
    ByteTokenizer,
    DataConfig,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_dataset,
    build_tokenizer,
    vocab_size,
)



def _file_vocab_size(path: str) -> int:
  import tokenizers

  return tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def test_byte_tokenizer_round_trips_any_text():
  tok = ByteTokenizer()
  text = "naïve café ✓ 𝔘"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, list(text.encode("utf-8")))
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
  assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
  assert tok.encode_batch(["ab", ""])[0].tolist() == [97, 98]


def test_byte_is_the_default_and_needs_no_file():
  assert isinstance(build_tokenizer(DataConfig()), ByteTokenizer)
  assert vocab_size(DataConfig()) == 259


def test_huggingface_file_with_its_own_special_tokens(tmp_path):
  path = hf_tokenizer_file(tmp_path)
  tok = build_tokenizer(DataConfig(tokenizer="huggingface", tokenizer_path=path))
  assert isinstance(tok, HuggingFaceTokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)  # found by name, not appended
  assert tok.vocab_size == _file_vocab_size(path)
  ids = tok.encode("the lazy fox")
  assert ids.dtype == np.int32 and ids.max() < tok.vocab_size
  assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "the lazy fox"
  batch = tok.encode_batch(["the lazy fox", "hello"])
  np.testing.assert_array_equal(batch[0], ids)
  np.testing.assert_array_equal(batch[1], tok.encode("hello"))


def test_huggingface_file_without_special_tokens_gets_appended_ids(tmp_path):
  path = hf_tokenizer_file(tmp_path, special_tokens=("<unk>",))
  tok = HuggingFaceTokenizer(path)
  base = _file_vocab_size(path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (base, base + 1, base + 2)
  assert tok.vocab_size == base + 3
  assert tok.decode([tok.bos_id, *tok.encode("hello"), tok.pad_id]) == "hello"


def test_sentencepiece_model(tmp_path):
  path = sentencepiece_file(tmp_path)
  tok = build_tokenizer(DataConfig(tokenizer="sentencepiece", tokenizer_path=path))
  assert isinstance(tok, SentencePieceTokenizer)
  # The trainer's defaults define BOS=1 and EOS=2 but no PAD: PAD reuses EOS,
  # so the vocabulary stays the file's (a pretrained embedding fits).
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 30)
  ids = tok.encode("the quick dog")
  assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "the quick dog"
  np.testing.assert_array_equal(tok.encode_batch(["the quick dog"])[0], ids)
  assert tok.encode_prompt("the quick dog").tolist() == [tok.bos_id, *ids]  # As transformers'.


def test_sentencepiece_model_without_bos_prompts_without_it(tmp_path):
  tok = SentencePieceTokenizer(sentencepiece_file(tmp_path, bos_id=-1))
  np.testing.assert_array_equal(tok.encode_prompt("the quick dog"), tok.encode("the quick dog"))


def test_huggingface_file_with_only_eos_reuses_it_for_bos_and_pad(tmp_path):
  # GPT-2 / SmolLM style: one <|endoftext|> and nothing else.
  path = hf_tokenizer_file(tmp_path, special_tokens=("<|endoftext|>",))
  tok = HuggingFaceTokenizer(path)
  eos = tok._tok.token_to_id("<|endoftext|>")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (eos, eos, eos)
  assert tok.vocab_size == _file_vocab_size(path)


def test_dataset_through_a_huggingface_tokenizer(tmp_path):
  path = hf_tokenizer_file(tmp_path)
  for i in range(30):
    (tmp_path / f"doc{i:02d}.txt").write_text(f"{TEXTS[i % 2]} {i}")
  config = DataConfig(
      source="text", paths=(str(tmp_path / "*.txt"),), tokenizer="huggingface",
      tokenizer_path=path, seq_len=8, batch_size=2, validation_fraction=0.0,
  )
  batch = next(iter(build_dataset(config, split="train", seed=0, process_index=0,
                                  process_count=1)))
  assert batch["inputs"].max() < vocab_size(config)
  assert {1, 2} & set(batch["inputs"].ravel().tolist())  # BOS/EOS frame documents


@pytest.mark.parametrize("kind", ["huggingface", "sentencepiece"])
def test_a_missing_tokenizer_file_is_named(tmp_path, kind):
  missing = str(tmp_path / "nope.bin")
  with pytest.raises(FileNotFoundError, match=rf"tokenizer_path=.*nope\.bin.*{kind}") as raised:
    build_tokenizer(DataConfig(tokenizer=kind, tokenizer_path=missing))
  assert isinstance(raised.value, DataError)


@pytest.mark.parametrize("kind, package", [("huggingface", "tokenizers"),
                                           ("sentencepiece", "sentencepiece")])
def test_a_file_that_is_no_tokenizer_is_named(tmp_path, kind, package):
  pytest.importorskip(package)
  (tmp_path / "junk.json").write_text("not a tokenizer")
  with pytest.raises(DataError, match=rf"tokenizer_path=.*junk\.json.*not a {kind} tokenizer"):
    build_tokenizer(DataConfig(tokenizer=kind, tokenizer_path=str(tmp_path / "junk.json")))


def test_a_file_tokenizer_needs_a_path():
  with pytest.raises(configlib.ConfigError, match="tokenizer_path"):
    configlib.from_dict(DataConfig, {"tokenizer": "huggingface"})


def test_digits_has_no_vocabulary():
  with pytest.raises(ConfigError, match="data.source='digits' is a labelled image set"):
    vocab_size(DataConfig(source="digits"))


@pytest.mark.parametrize("kind, package", [("huggingface", "tokenizers"),
                                           ("sentencepiece", "sentencepiece")])
def test_a_missing_tokenizer_package_names_the_extra(tmp_path, monkeypatch, kind, package):
  monkeypatch.setitem(sys.modules, package, None)  # importing it now fails
  (tmp_path / "tok").write_text("{}")
  with pytest.raises(MissingExtraError, match=rf"'{package}' .*jax-ai-stack\[tokenizers\]"):
    build_tokenizer(DataConfig(tokenizer=kind, tokenizer_path=str(tmp_path / "tok")))


def test_a_prompt_gets_bos_where_the_file_s_post_processor_adds_it(tmp_path):
  """Gemma's and Llama 3's tokenizer.json add BOS in their post-processor, as transformers'
  `tokenizer(text)` does; `encode` (for corpora, which add their own BOS) does not."""
  import tokenizers
  from tokenizers import processors

  path = hf_tokenizer_file(tmp_path)
  tok = tokenizers.Tokenizer.from_file(path)
  plain = HuggingFaceTokenizer(path)
  np.testing.assert_array_equal(plain.encode_prompt("the fox"), plain.encode("the fox"))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(path)
  with_bos = HuggingFaceTokenizer(path)
  assert with_bos.encode_prompt("the fox").tolist() == [1, *with_bos.encode("the fox").tolist()]
  assert ByteTokenizer().encode_prompt("hé").tolist() == [104, 195, 169]
