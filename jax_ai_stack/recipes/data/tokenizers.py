"""Tokenizers behind one small interface: encode, decode, vocab_size, special ids.

The byte tokenizer is the default because it needs no file and no download:
every UTF-8 byte is a token (0..255), followed by BOS, EOS and PAD, so the
vocabulary is 259. A Hugging Face `tokenizers` JSON file or a SentencePiece
model can be used instead (extra `jax-ai-stack[tokenizers]`). When such a file
defines no BOS/EOS/PAD token, the missing ones get fresh ids after its
vocabulary, so every tokenizer has all three and the model's vocabulary is
`tokenizer.vocab_size`.

Example:
  >>> tok = ByteTokenizer()
  >>> tok.encode("hé").tolist(), tok.vocab_size, tok.eos_id
  ([104, 195, 169], 259, 257)
  >>> tok.decode([tok.bos_id, 104, 195, 169, tok.eos_id])
  'hé'
"""

from __future__ import annotations

import abc
import pathlib
import re
from collections.abc import Sequence

import numpy as np

from jax_ai_stack.errors import DataError, MissingExtraError
from jax_ai_stack.recipes.data.config import DataConfig, require_token_source
from jax_ai_stack.recipes.data.sources import DataFileNotFoundError

# Names under which tokenizer files commonly store their special tokens.
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
# Tokens that end a turn in common chat formats (ChatML, Llama 3, Gemma, Phi).
_END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>", "<|end|>")


class Tokenizer(abc.ABC):
  """Text <-> int ids. `encode` adds no special tokens; `decode` drops them."""

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  @abc.abstractmethod
  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text`, without BOS/EOS."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """The text of `ids`; special and padding ids are skipped."""

  def encode_prompt(self, text: str) -> np.ndarray:
    """A prompt's ids as the tokenizer's own file encodes it (a Hugging Face tokenizer.json's
    post-processor adds BOS where its model expects one, Gemma's and Llama 3's); plain
    `encode` where the file has no such rule."""
    return self.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of each text; subclasses batch it in native code where they can."""
    return [self.encode(text) for text in texts]

  @property
  def special_ids(self) -> tuple[int, int, int]:
    return (self.bos_id, self.eos_id, self.pad_id)

  def token_text(self, token_id: int) -> str:
    """The text that stands for one special id in a chat template (`bos_token`)."""
    return {self.bos_id: "<|bos|>", self.eos_id: "<|eos|>", self.pad_id: "<|pad|>"}[token_id]

  def end_of_turn_ids(self) -> list[int]:
    """Ids that end an assistant's turn: EOS, and the turn tokens of the common chat formats
    that this tokenizer defines (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...)."""
    return [self.eos_id]

  def encode_rendered(self, text: str) -> np.ndarray:
    """`encode` of a chat template's output: the BOS and EOS texts in it become their ids
    (a tokenizer file's other added tokens, `<|im_start|>` say, are its own to match)."""
    specials = {self.token_text(i): i for i in (self.bos_id, self.eos_id)}
    parts = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
    ids = [np.asarray([specials[part]], np.int32) if part in specials else self.encode(part)
           for part in parts if part]
    return np.concatenate(ids) if ids else np.zeros(0, np.int32)

  def __repr__(self) -> str:
    return (
        f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id},"
        f" eos_id={self.eos_id}, pad_id={self.pad_id})"
    )


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255; BOS=256, EOS=257, PAD=258."""

  vocab_size = 259
  bos_id = 256
  eos_id = 257
  pad_id = 258

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = np.asarray(ids)
    return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def token_bytes(self) -> list[bytes]:
    """Each id's bytes in decoded text (b"": a special id), what a grammar matches tokens
    against (`inference.grammar`; a Hugging Face tokenizer gives it its tokenizer.json)."""
    return [bytes([i]) for i in range(256)] + [b""] * 3


def _special_ids(find_id, base_size: int) -> tuple[tuple[int, int, int], int]:
  """(bos, eos, pad) ids found by `find_id(name_list)`, missing ones supplied.

  A file without BOS or PAD reuses its own EOS for them (as transformers does:
  Llama, SmolLM and GPT-2 files define no PAD, some no BOS), so the vocabulary
  stays the file's and a pretrained model's embedding fits. Padding is masked
  out of the loss, so PAD == EOS costs nothing. Ids still missing (no EOS
  either) are appended after the file's vocabulary.

  Returns the three ids and the vocabulary size including appended ids.
  """
  bos, eos, pad = (find_id(names) for names in (_BOS_NAMES, _EOS_NAMES, _PAD_NAMES))
  if eos is not None:
    bos = eos if bos is None else bos
    pad = eos if pad is None else pad
  ids, size = [], base_size
  for found in (bos, eos, pad):
    if found is None:
      found, size = size, size + 1
    ids.append(found)
  return tuple(ids), size


def _check_file(path: str | None, kind: str) -> pathlib.Path:
  if not path or not pathlib.Path(path).is_file():
    raise DataFileNotFoundError(
        f"data.tokenizer_path={path!r}: no such file (tokenizer={kind!r})")
  return pathlib.Path(path)


def _missing_extra(package: str) -> MissingExtraError:
  return MissingExtraError(
      f"the {package!r} package is not installed; install the extra:"
      " pip install 'jax-ai-stack[tokenizers]'"
  )


def _unreadable(path: str, kind: str, error: Exception) -> DataError:
  return DataError(f"data.tokenizer_path={path!r}: not a {kind} tokenizer file: {error}")


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face `tokenizers` JSON file (tokenizer.json)."""

  def __init__(self, path: str):
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise _missing_extra("tokenizers") from None
    self.path = str(_check_file(path, "huggingface"))
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.path)
    except Exception as e:  # the library raises its own exception types
      raise _unreadable(self.path, "huggingface", e) from None
    self._base_size = self._tok.get_vocab_size(with_added_tokens=True)

    def find(names):
      return next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _special_ids(find, self._base_size)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_prompt(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=np.int32)

  def token_text(self, token_id: int) -> str:
    text = self._tok.id_to_token(token_id) if token_id < self._base_size else None
    return text if text is not None else super().token_text(token_id)

  def end_of_turn_ids(self) -> list[int]:
    found = (self._tok.token_to_id(name) for name in _END_OF_TURN_NAMES)
    return [self.eos_id, *(i for i in found if i is not None and i != self.eos_id)]

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    keep = [int(i) for i in ids if i < self._base_size and i not in self.special_ids]
    return self._tok.decode(keep, skip_special_tokens=True)


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file (.model)."""

  def __init__(self, path: str):
    try:
      import sentencepiece  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise _missing_extra("sentencepiece") from None
    self.path = str(_check_file(path, "sentencepiece"))
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
    except Exception as e:  # the library raises its own exception types
      raise _unreadable(self.path, "sentencepiece", e) from None
    self._base_size = self._sp.get_piece_size()
    # SentencePiece reports -1 for a special token the model does not define.
    own = iter((self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()))

    def find(names):
      del names
      found = next(own)
      return found if found >= 0 else None

    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _special_ids(find, self._base_size)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), dtype=np.int32)

  def encode_prompt(self, text: str) -> np.ndarray:
    """With BOS first where the model defines one, as transformers' SentencePiece tokenizers
    (Llama 2's, Gemma's: `add_bos_token`) and SentencePiece's `add_bos` encode a prompt."""
    return np.asarray(self._sp.encode(text, add_bos=self._sp.bos_id() >= 0), dtype=np.int32)

  def token_text(self, token_id: int) -> str:
    if token_id < self._base_size:
      return self._sp.id_to_piece(token_id)
    return super().token_text(token_id)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]

  def token_bytes(self) -> list[bytes]:
    """A piece's text with "▁" as the space it stands for, a byte piece (<0x0A>) as its
    byte, control and unknown pieces as nothing."""
    def piece(i: int) -> bytes:
      if i >= self._base_size or self._sp.is_control(i) or self._sp.is_unknown(i):
        return b""
      text = self._sp.id_to_piece(i)
      if self._sp.is_byte(i):
        return bytes([int(text[3:5], 16)])
      return text.replace("\u2581", " ").encode("utf-8")

    return [piece(i) for i in range(self.vocab_size)]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    keep = [int(i) for i in ids if i < self._base_size and i not in self.special_ids]
    return self._sp.decode(keep)


def build_tokenizer(config: DataConfig) -> Tokenizer:
  """The tokenizer named by `config.tokenizer`.

  Raises:
    DataFileNotFoundError: `config.tokenizer_path` does not exist.
    DataError: the file is not a tokenizer of that kind.
    MissingExtraError: the tokenizer's optional package is missing (names the extra).
  """
  if config.tokenizer == "byte":
    return ByteTokenizer()
  if config.tokenizer == "huggingface":
    return HuggingFaceTokenizer(config.tokenizer_path)
  return SentencePieceTokenizer(config.tokenizer_path)


def vocab_size(config: DataConfig) -> int:
  """The vocabulary the model must cover (special ids included); token sources only."""
  require_token_source(config, "vocabulary")
  return build_tokenizer(config).vocab_size
