"""Reading a prepared token cache: its counts, document offsets and token slices; the splits.

`TokenCache.open` checks that a cache fits a config and reads token slices
(only the blocks they touch); `split_corpora` turns it into the same
train/validation `TokenCorpus` pair as the in-memory path, whose `tokens` read
from the cache; `load_cached_corpus` prepares the cache first if needed.

Example:
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> config = DataConfig(source="text", paths=("*.txt",), cache="cache")
  >>> corpora = load_cached_corpus(config)  # Prepares it: the first use.
  >>> cache = TokenCache.open("cache", config)
  >>> cache.doc_offsets().tolist(), cache.take(np.array([[0, 1], [5, 6]])).tolist()
  ([0, 5, 12], [[256, 97], [256, 104]])
  >>> len(corpora["train"].tokens) + len(corpora["validation"].tokens)
  12
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.token_cache.identity import (
    MANIFEST, Manifest, _identity, _refuse_differences)
from jax_ai_stack.recipes.data.token_cache.store import _Location, _open_array, _read_json
from jax_ai_stack.recipes.data.token_cache.writer import prepare
from jax_ai_stack.recipes.data.tokenizers import build_tokenizer


class TokenCache:
  """A prepared cache: counts, document offsets and token reads (only the chunks needed)."""

  def __init__(self, location: _Location, manifest: Manifest):
    self.location = location
    self.manifest = manifest
    self._arrays: dict[str, ts.TensorStore] = {}

  @classmethod
  def open(cls, where: str | os.PathLike, config: DataConfig | None = None) -> TokenCache:
    """Opens the cache at `where`; with `config`, refuses one of another corpus.

    Raises:
      DataError: no finished cache there, a newer format, another tokenizer or
        changed source files (named), or a missing token chunk (named).
    """
    location = _Location(where)
    value = _read_json(location, MANIFEST)
    if value is None:
      raise DataError(f"token cache {location.where}: no {MANIFEST}: not a finished cache;"
                      " run `jax-ai-stack data prepare --cache ...` (it resumes)")
    manifest = Manifest.from_json(location.where, value)
    if config is not None:
      tokenizer = build_tokenizer(config)
      current = _identity(config, tokenizer, chunk_tokens=0, shard_documents=0,
                          recorded=manifest.sources)
      _refuse_differences(location.where, manifest.identity(), current, prefix_ok=True)
    cache = cls(location, manifest)
    cache._check_chunks()
    return cache

  def _check_chunks(self) -> None:
    chunk = self.manifest.layout["chunk_tokens"]
    expected = {f"tokens/c/{i}" for i in range(-(-self.num_tokens // chunk))}
    missing = sorted(expected - self.location.keys("tokens/c/"), key=lambda k: int(k[9:]))
    if missing:
      raise DataError(
          f"token cache {self.location.where}: array 'tokens' lacks chunk {missing[0]}"
          f" ({len(missing)} missing); delete the cache and prepare it again")

  def _array(self, name: str) -> ts.TensorStore:
    if name not in self._arrays:
      self._arrays[name] = _open_array(self.location, name, create=False)
    return self._arrays[name]

  def _read(self, name: str, view) -> np.ndarray:
    try:
      return view(self._array(name)).read().result()
    except ValueError as e:
      raise DataError(
          f"token cache {self.location.where}: array {name!r} is damaged: {e}; delete the"
          " cache and prepare it again") from None

  @property
  def num_tokens(self) -> int:
    return self.manifest.num_tokens

  @property
  def num_documents(self) -> int:
    return self.manifest.num_documents

  def doc_offsets(self) -> np.ndarray:
    """int64 [num_documents + 1]: document d is tokens [o[d], o[d + 1])."""
    offsets = self._read("doc_offsets", lambda a: a[:self.num_documents + 1])
    if offsets[0] != 0 or offsets[-1] != self.num_tokens or np.any(np.diff(offsets) < 1):
      raise DataError(f"token cache {self.location.where}: array 'doc_offsets' is damaged"
                      " (not increasing from 0 to num_tokens); prepare the cache again")
    return offsets

  def doc_digests(self) -> np.ndarray:
    """uint8 [num_documents, 16]: what each document's train/validation split hashes."""
    return self._read("doc_digests", lambda a: a[:self.num_documents])

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop)."""
    return self._read("tokens", lambda a: a[start:stop])

  def take(self, indices: np.ndarray) -> np.ndarray:
    """Tokens at the int array `indices` (any shape); reads only the blocks they touch.

    A batch's indices are a few runs of consecutive positions (its windows):
    each run is read as one slice, all at once, which is far faster than
    TensorStore's point-wise `vindex` for the same tokens.
    """
    indices = np.asarray(indices, dtype=np.int64)
    flat = indices.reshape(-1)
    if not flat.size:
      return np.zeros(indices.shape, self.manifest.dtype)
    starts = np.flatnonzero(np.diff(flat, prepend=flat[0] - 2) != 1)
    ends = np.append(starts[1:], flat.size)
    try:
      tokens = self._array("tokens")
      reads = [tokens[flat[a]:flat[b - 1] + 1].read() for a, b in zip(starts, ends)]
      return np.concatenate([read.result() for read in reads]).reshape(indices.shape)
    except ValueError as e:
      raise DataError(
          f"token cache {self.location.where}: array 'tokens' is damaged: {e}; delete the"
          " cache and prepare it again") from None

  def __getstate__(self):
    return {"where": self.location.where, "manifest": self.manifest}

  def __setstate__(self, state):
    self.__init__(_Location(state["where"]), state["manifest"])

  def __repr__(self) -> str:
    return (f"TokenCache({self.location.where}, documents={self.num_documents},"
            f" tokens={self.num_tokens})")


class CachedTokens:
  """One split's token stream, read from a cache: `len` and NumPy integer indexing.

  The split's documents are runs of the cache's flat array; position i of the
  split is run r's global start plus i minus the run's split start.
  """

  def __init__(self, cache: TokenCache, run_starts: np.ndarray, split_starts: np.ndarray):
    self.cache = cache
    self._run_starts = run_starts  # int64 [runs]: start of each run in the cache
    self._split_starts = split_starts  # int64 [runs + 1]: start of each run in the split
    self.dtype = cache.manifest.dtype
    self.ndim = 1

  def __len__(self) -> int:
    return int(self._split_starts[-1])

  @property
  def shape(self) -> tuple[int]:
    return (len(self),)

  def __getitem__(self, key) -> np.ndarray:
    if isinstance(key, slice):
      key = np.arange(*key.indices(len(self)))
    indices = np.asarray(key)
    if not np.issubdtype(indices.dtype, np.integer):
      raise TypeError(f"CachedTokens takes integer indices or a slice, got {key!r}")
    indices = np.where(indices < 0, indices + len(self), indices).astype(np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
      raise IndexError(f"index out of range for {len(self)} tokens")
    runs = np.searchsorted(self._split_starts, indices, side="right") - 1
    return self.cache.take(self._run_starts[runs] + indices - self._split_starts[runs])

  def __repr__(self) -> str:
    return f"CachedTokens({self.cache!r}, tokens={len(self)})"


def split_corpora(cache: TokenCache, config: DataConfig) -> dict[str, corpus_lib.TokenCorpus]:
  """The train/validation `TokenCorpus` pair `corpus.load_in_memory` would build, read from `cache`."""
  num_docs = cache.num_documents
  if config.max_documents is not None:
    num_docs = min(num_docs, config.max_documents)
  offsets = cache.doc_offsets()[:num_docs + 1].tolist()
  digests = cache.doc_digests()[:num_docs]
  runs: dict[str, list[tuple[int, int]]] = {"train": [], "validation": []}
  for d in range(num_docs):
    start, length = offsets[d], offsets[d + 1] - offsets[d]
    for held_out, a, b in corpus_lib.split_runs(
        digests[d].tobytes(), length, config.split_chunk_tokens, config.holdout_fraction):
      runs["validation" if held_out else "train"].append((start + a, b - a))
  corpora = {}
  for split, pieces in runs.items():
    starts = np.array([p[0] for p in pieces], dtype=np.int64)
    lengths = np.array([p[1] for p in pieces], dtype=np.int64)
    split_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    split_starts.flags.writeable = False
    corpora[split] = corpus_lib.TokenCorpus(
        CachedTokens(cache, starts, split_starts), split_starts,
        f"{corpus_lib.describe(config)}, cache={cache.location.where!r}, split={split!r}")
  return corpora


def load_cached_corpus(config: DataConfig) -> dict[str, corpus_lib.TokenCorpus]:
  """`corpora.load_corpus` for `data.cache`: prepares the cache if it has no manifest, then reads it.

  With several processes nobody prepares it (they would all write the same
  files at once): it must be prepared first, once.
  """
  if _read_json(_Location(config.cache), MANIFEST) is None:
    import jax

    if jax.process_count() > 1:
      raise DataError(
          f"data.cache={config.cache} has no finished cache, and {jax.process_count()} processes "
          "cannot all prepare it: run `jax-ai-stack data prepare ... --cache "
          f"{config.cache}` once, on one host, then launch the job")
    prepare(config, config.cache)
  return split_corpora(TokenCache.open(config.cache, config), config)

