"""Preparing a token cache: shards of tokens appended to the arrays, each committed by a ledger.

Crash safety: a shard's chunks are written first, then its ledger file
`shards/NNNNN.json` atomically; only then is the shard committed. A rerun
continues after the last committed shard and rewrites whatever a killed run
had written beyond it with the same bytes (a chunk's bytes depend on its
contents alone), so it ends byte-identical to an uninterrupted run. The
manifest is written last: its presence means the cache is complete.

Example:
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> config = DataConfig(source="text", paths=("*.txt",))
  >>> manifest = prepare(config, "cache", shard_documents=1, progress=False)
  >>> manifest.num_documents, manifest.num_tokens, manifest.num_shards
  (2, 12, 2)
  >>> [ledger["tokens"] for ledger in _committed(_Location("cache"))]
  [[0, 5], [5, 12]]
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes import progress as progress_lib
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.config import DataConfig, require_token_source
from jax_ai_stack.recipes.data.token_cache.identity import (
    IDENTITY, MANIFEST, Manifest, _check_version, _identity, _refuse_differences)
from jax_ai_stack.recipes.data.token_cache.store import (
    _DIGEST_BYTES, DEFAULT_CHUNK_TOKENS, READ_BLOCK_TOKENS, _grow, _Location, _open_array,
    _read_json, _to_json, _token_codecs)
from jax_ai_stack.recipes.data.token_cache.workers import _Shard, _shards
from jax_ai_stack.recipes.data.tokenizers import build_tokenizer

DEFAULT_SHARD_DOCUMENTS = 1024


class _Writer:
  """Appends shards of documents to the three arrays and commits each with its ledger."""

  def __init__(self, location: _Location, dtype: np.dtype, chunk_tokens: int,
               block_tokens: int, shard_documents: int):
    self.location = location
    self.arrays = {
        "tokens": _open_array(location, "tokens", create=True, dtype=dtype,
                              chunk_shape=chunk_tokens, codecs=_token_codecs(block_tokens)),
        "doc_offsets": _open_array(location, "doc_offsets", create=True, dtype=np.int64,
                                   chunk_shape=shard_documents),
        "doc_digests": _open_array(location, "doc_digests", create=True, dtype=np.uint8,
                                   chunk_shape=shard_documents, inner=(_DIGEST_BYTES,)),
    }
    self.dtype = dtype

  def write_shard(self, first_doc: int, first_token: int, shard: _Shard) -> tuple[int, int]:
    """Writes and waits for the shard's chunks; returns the end (document, token)."""
    offsets = first_token + np.concatenate([[0], np.cumsum(shard.lengths)])
    tokens, digests = shard.tokens, shard.digests
    end_doc, end_token = first_doc + len(shard.lengths), int(offsets[-1])
    arrays = self.arrays
    arrays["tokens"] = _grow(arrays["tokens"], end_token)
    arrays["doc_offsets"] = _grow(arrays["doc_offsets"], end_doc + 1)
    arrays["doc_digests"] = _grow(arrays["doc_digests"], end_doc)
    writes = [
        arrays["tokens"][first_token:end_token].write(tokens),
        arrays["doc_offsets"][first_doc:end_doc + 1].write(offsets),
        arrays["doc_digests"][first_doc:end_doc].write(digests),
    ]
    for write in writes:
      write.result()
    return end_doc, end_token

  def finish(self, num_documents: int, num_tokens: int) -> None:
    """Trims the shapes to the counts (they only differ after an odd interrupted run)."""
    for name, size in (("tokens", num_tokens), ("doc_offsets", num_documents + 1),
                       ("doc_digests", num_documents)):
      array = self.arrays[name]
      if array.shape[0] != size:
        array.resize(exclusive_max=[size, *array.shape[1:]], resize_metadata_only=True).result()


def _shard_name(shard: int) -> str:
  return f"shards/{shard:05d}.json"


def _committed(location: _Location) -> list[dict]:
  """The ledgers of the consecutive committed shards 0, 1, ..."""
  ledgers = []
  while (ledger := _read_json(location, _shard_name(len(ledgers)))) is not None:
    ledgers.append(ledger)
  return ledgers


def prepare(
    config: DataConfig,
    location: str | os.PathLike,
    *,
    shard_documents: int = DEFAULT_SHARD_DOCUMENTS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    read_block_tokens: int = READ_BLOCK_TOKENS,
    progress: bool = True,
    on_shard: Callable[[int, str], None] | None = None,
    workers: int = 1,
) -> Manifest:
  """Tokenizes `config`'s source once into a token cache at `location`; resumable.

  Args:
    config: the source, tokenizer and document settings (split, seq_len and
      batching are not part of a cache: they are applied when reading).
    location: a directory or a kvstore URL.
    shard_documents: documents per shard: the unit of progress kept by a
      killed run, and the chunk length of the document arrays.
    chunk_tokens: tokens per chunk (file) of the token array.
    read_block_tokens: tokens per separately compressed block of a chunk, what
      reading a window decompresses (used when it divides `chunk_tokens`).
    progress: a tqdm bar on stderr (documents, tokens/s).
    on_shard: called with (shard, "written") once its chunks are written and
      (shard, "committed") once its ledger is; tests kill the process there.
    workers: processes that tokenize (1: this one); the cache is the same
      bytes whatever the number.

  Returns:
    The manifest; a finished cache that fits the config is left as it is.

  Raises:
    DataError: the cache location cannot hold a cache, holds one of another
      config or of a newer format, or the corpus is empty or unreadable.
  """
  require_token_source(config, "token cache")
  if min(shard_documents, chunk_tokens, read_block_tokens, workers) < 1:
    raise ValueError(f"shard_documents={shard_documents}, chunk_tokens={chunk_tokens},"
                     f" read_block_tokens={read_block_tokens} and workers={workers} must be >= 1")
  location = _Location(location)
  location.make_writable()
  tokenizer = build_tokenizer(config)
  existing = _read_json(location, MANIFEST)
  if existing is not None:
    manifest = Manifest.from_json(location.where, existing)
    current = _identity(config, tokenizer, chunk_tokens=chunk_tokens,
                        shard_documents=shard_documents, read_block_tokens=read_block_tokens,
                        recorded=manifest.sources)
    _refuse_differences(location.where, manifest.identity(), current, prefix_ok=False)
    if progress:
      print(f"token cache {location.where}: complete ({manifest.num_documents} documents,"
            f" {manifest.num_tokens} tokens); nothing to do", file=sys.stderr)
    return manifest
  recorded = _read_json(location, IDENTITY)
  identity = _identity(config, tokenizer, chunk_tokens=chunk_tokens,
                       shard_documents=shard_documents, read_block_tokens=read_block_tokens,
                       recorded=recorded["sources"] if recorded else None)
  if recorded is not None:
    _check_version(location.where, recorded)
    _refuse_differences(location.where, recorded, identity, prefix_ok=False, unfinished=True)
    identity = recorded  # keeps its mtimes: a rerun writes nothing new there
  ledgers = _committed(location)
  num_docs = ledgers[-1]["documents"][1] if ledgers else 0
  num_tokens = ledgers[-1]["tokens"][1] if ledgers else 0
  shards = _shards(config, tokenizer, skip=num_docs, shard_documents=shard_documents,
                   workers=workers)
  with contextlib.closing(shards):  # stops the worker processes on an error
    first = next(shards, None)
    if first is None and not num_docs:
      raise DataError(
          f"data: the corpus is empty ({corpus_lib.describe(config)}): no non-empty document;"
          f" nothing was written to {location.where}")
    if recorded is None:
      location.write(IDENTITY, _to_json(identity))
    writer = _Writer(location, corpus_lib.token_dtype(tokenizer), chunk_tokens,
                     identity["layout"]["read_block_tokens"], shard_documents)
    shard, start = len(ledgers), time.monotonic()
    new_tokens = 0
    bar = (progress_lib.bar("tokenize", unit="doc", total=sources.count_documents(config),
                            initial=num_docs) if progress else None)
    try:
      for packed in itertools.chain([first] if first is not None else [], shards):
        end_doc, end_token = writer.write_shard(num_docs, num_tokens, packed)
        if on_shard:
          on_shard(shard, "written")
        location.write(_shard_name(shard), _to_json(
            {"documents": [num_docs, end_doc], "tokens": [num_tokens, end_token]}))
        if on_shard:
          on_shard(shard, "committed")
        new_tokens += end_token - num_tokens
        if bar is not None:
          bar.update(end_doc - num_docs)
          bar.set_postfix_str(
              f"{new_tokens / max(time.monotonic() - start, 1e-9):,.0f} tokens/s")
        shard, num_docs, num_tokens = shard + 1, end_doc, end_token
    finally:
      if bar is not None:
        bar.close()
  writer.finish(num_docs, num_tokens)
  manifest = Manifest(**identity, num_documents=num_docs, num_tokens=num_tokens,
                      num_shards=shard)
  location.write(MANIFEST, _to_json(dataclasses.asdict(manifest)))
  return manifest

