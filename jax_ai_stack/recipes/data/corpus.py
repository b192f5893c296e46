"""A tokenized corpus in memory, split into train and validation by chunk hash.

Documents are tokenized once and concatenated into one flat array per split,
so that examples are later cut out by slicing, never by per-token Python.
Text documents become `[BOS, *ids, EOS]`; pre-tokenized `.npy` documents are
kept as they are.

The split: each document is cut into chunks of `data.split_chunk_tokens`
tokens (the last one shorter), and chunk k goes to validation when a hash of
(the document's content, k) is below `data.validation_fraction`. So one long
file gives both splits in the set proportion, while a document shorter than a
chunk moves whole, as before. The side of a chunk depends on nothing but its
document and its position there: adding, removing or reordering other
documents never moves it, and duplicate documents land on the same side chunk
by chunk. Consecutive chunks of a document on the same side stay one piece,
so packing only starts a new segment where the split cut the document.

The result is cached per (config fields that matter, file sizes and mtimes),
so building the train and the validation dataset reads the files once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sized

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.config import DataConfig, require_token_source
from jax_ai_stack.recipes.data.tokenizers import Tokenizer, build_tokenizer

Split = str  # "train" or "validation"
_ENCODE_CHUNK = 256  # documents per encode_batch call
_CACHE_SIZE = 2
_cache: dict[tuple, dict[Split, TokenCorpus]] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCorpus:
  """Documents of one split, back to back.

  A "document" here is what the split kept of one: the whole document, or
  each run of its consecutive chunks that fell on this side.

  Attributes:
    tokens: all token ids, uint16 when the vocabulary fits, else int32; read-only.
      A NumPy array, or a token cache's view (`token_cache.CachedTokens`):
      anything with `len` and NumPy integer-array indexing.
    doc_starts: int64 [num_documents + 1]; document d is
      `tokens[doc_starts[d]:doc_starts[d + 1]]`.
    description: where it came from, for messages and a stable `repr`.
  """

  tokens: np.ndarray
  doc_starts: np.ndarray
  description: str

  @property
  def num_documents(self) -> int:
    return len(self.doc_starts) - 1

  @property
  def num_tokens(self) -> int:
    return len(self.tokens)

  def document(self, index: int) -> np.ndarray:
    return self.tokens[self.doc_starts[index]:self.doc_starts[index + 1]]

  def __repr__(self) -> str:
    return (
        f"TokenCorpus({self.description}, documents={self.num_documents},"
        f" tokens={self.num_tokens})"
    )


def hash_fraction(content: bytes) -> float:
  """A number in [0, 1) fixed by `content` alone (BLAKE2b; same on every machine)."""
  digest = hashlib.blake2b(content, digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def document_digest(content: bytes) -> bytes:
  """The 16-byte BLAKE2b digest of a document that its chunks' split is hashed from.

  A token cache stores it per document, so the split can be recomputed for
  any `validation_fraction` without the text.
  """
  return hashlib.blake2b(content, digest_size=16).digest()


def held_out_chunks(
    content: bytes, num_tokens: int, chunk_tokens: int, fraction: float
) -> np.ndarray:
  """Which chunks of a document of `num_tokens` tokens go to validation.

  Chunk k holds tokens [k * chunk_tokens, (k + 1) * chunk_tokens) and is held
  out when `hash_fraction(digest(content) + k)` < `fraction`: a pure function
  of the document and the position, so the split needs no global state.

  Example:
    >>> held_out_chunks(b"one long document", 2000, 512, 0.5).tolist()
    [False, False, True, False]
  """
  return _held_out(document_digest(content), num_tokens, chunk_tokens, fraction)


def _held_out(digest: bytes, num_tokens: int, chunk_tokens: int, fraction: float) -> np.ndarray:
  num_chunks = -(-num_tokens // chunk_tokens)
  return np.array(
      [hash_fraction(digest + k.to_bytes(8, "little")) < fraction for k in range(num_chunks)],
      dtype=bool,
  )


def split_runs(
    digest: bytes, num_tokens: int, chunk_tokens: int, fraction: float
) -> Iterator[tuple[bool, int, int]]:
  """`(held out, start, stop)` token ranges of each run of chunks that land on one side.

  Example:
    >>> list(split_runs(document_digest(b"one long document"), 2000, 512, 0.5))
    [(False, 0, 1024), (True, 1024, 1536), (False, 1536, 2000)]
  """
  held_out = _held_out(digest, num_tokens, chunk_tokens, fraction)
  if not held_out.size:
    return
  cuts = (np.flatnonzero(held_out[1:] != held_out[:-1]) + 1).tolist()
  for start, stop in zip([0, *cuts], [*cuts, len(held_out)]):
    yield bool(held_out[start]), start * chunk_tokens, min(stop * chunk_tokens, num_tokens)


def split_document(
    content: bytes, ids: np.ndarray, chunk_tokens: int, fraction: float
) -> Iterator[tuple[bool, np.ndarray]]:
  """`(held out, tokens)` of each run of consecutive chunks that land on one side."""
  runs = split_runs(document_digest(content), len(ids), chunk_tokens, fraction)
  for held_out, start, stop in runs:
    yield held_out, ids[start:stop]


def _take_documents(
    documents: Iterable[tuple[str, Sized]], max_documents: int | None
) -> Iterator[Sized]:
  """The non-empty documents, at most `max_documents` of them (read lazily)."""
  non_empty = (document for _, document in documents if len(document))
  return itertools.islice(non_empty, max_documents)


def tokenized_documents(
    config: DataConfig, tokenizer: Tokenizer, *, skip: int = 0
) -> Iterator[tuple[bytes, np.ndarray]]:
  """`(content for the split hash, token ids)` of each document, in source order.

  The first `skip` documents are read but not tokenized (a resumed token cache).
  """
  if config.source == "npy":
    arrays = sources.read_token_arrays(config, tokenizer.vocab_size, tokenizer.eos_id)
    for ids in itertools.islice(_take_documents(arrays, config.max_documents), skip, None):
      yield np.ascontiguousarray(ids, dtype="<i8").tobytes(), ids
    return
  texts = document_texts(config, skip=skip)
  while chunk := list(itertools.islice(texts, _ENCODE_CHUNK)):
    yield from tokenize_texts(tokenizer, chunk)


def document_texts(config: DataConfig, *, skip: int = 0) -> Iterator[str]:
  """The non-empty documents of a text source, in source order, after the first `skip`.

  Reading and tokenizing are apart so that a token cache can read here and
  tokenize in worker processes.
  """
  texts = _take_documents(sources.read_texts(config), config.max_documents)
  return itertools.islice(texts, skip, None)


def tokenize_texts(tokenizer: Tokenizer, texts: list[str]) -> list[tuple[bytes, np.ndarray]]:
  """`(content for the split hash, [BOS, *ids, EOS])` of each text."""
  bos, eos = np.int32([tokenizer.bos_id]), np.int32([tokenizer.eos_id])
  return [(text.encode("utf-8", "surrogatepass"), np.concatenate([bos, ids, eos]))
          for text, ids in zip(texts, tokenizer.encode_batch(texts))]


def _concatenate(documents: list[np.ndarray], dtype, description: str) -> TokenCorpus:
  lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
  doc_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.concatenate(documents).astype(dtype) if documents else np.zeros(0, dtype)
  tokens.flags.writeable = False
  doc_starts.flags.writeable = False
  return TokenCorpus(tokens, doc_starts, description)


def token_dtype(tokenizer: Tokenizer) -> np.dtype:
  """uint16 when the vocabulary fits, else int32: how corpora and caches store ids."""
  return np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)


def describe(config: DataConfig) -> str:
  """Where the corpus comes from, for messages."""
  where = f"source={config.source!r}"
  if config.paths:
    where += f" paths={list(config.paths)!r}"
  return where


def _build(config: DataConfig) -> dict[Split, TokenCorpus]:
  tokenizer = build_tokenizer(config)
  dtype = token_dtype(tokenizer)
  splits: dict[Split, list[np.ndarray]] = {"train": [], "validation": []}
  for content, ids in tokenized_documents(config, tokenizer):
    for held_out, piece in split_document(
        content, ids, config.split_chunk_tokens, config.holdout_fraction):
      splits["validation" if held_out else "train"].append(piece)
  if not splits["train"] and not splits["validation"]:
    raise DataError(f"data: the corpus is empty ({describe(config)}): no non-empty document")
  return {
      split: _concatenate(docs, dtype, f"{describe(config)}, split={split!r}")
      for split, docs in splits.items()
  }


def _stamp(path) -> tuple[str, int, int]:
  stat = os.stat(path)
  return (str(path), stat.st_size, stat.st_mtime_ns)


def _cache_key(config: DataConfig) -> tuple:
  """The fields that change the corpus, and each input file's size and mtime."""
  if config.source == "stdlib":
    files = sources.stdlib_files(config.paths)
  else:
    files = sources.resolve_paths(config.paths)
  if config.tokenizer != "byte" and os.path.isfile(config.tokenizer_path):
    files.append(config.tokenizer_path)
  return (
      config.source, config.text_column, config.tokenizer, config.tokenizer_path,
      config.max_documents, config.holdout_fraction, config.split_chunk_tokens,
      config.encoding_errors,
      tuple(map(_stamp, files)),
  )


def load_in_memory(config: DataConfig) -> dict[Split, TokenCorpus]:
  """`{"train": TokenCorpus, "validation": TokenCorpus}` for a token source, held in memory.

  What `corpora.load_corpus` gives when `data.cache` is unset (with it, the
  tokens are read from that TensorStore cache instead, `token_cache`).

  Raises:
    DataError: the corpus is empty, or a file holds bad data (names the file);
      a path, glob or tokenizer file that matches nothing is also a
      FileNotFoundError.
    ConfigError: the source is an image set.
  """
  require_token_source(config, "token corpus")
  key = _cache_key(config)
  if key not in _cache:
    corpus = _build(config)
    while len(_cache) >= _CACHE_SIZE:
      _cache.pop(next(iter(_cache)))
    _cache[key] = corpus
  return _cache[key]
