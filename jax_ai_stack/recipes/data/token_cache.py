"""A tokenized corpus on disk: tokenized once with TensorStore, read per batch.

Re-reading and re-tokenizing a large corpus at every start costs minutes and
holds every token in memory. `prepare(config, location)` tokenizes `data`'s
source once into a cache; `TokenCache.open` checks that a cache fits a config
and reads token slices (only the chunks they touch); `load_cached_corpus`
turns it into the same train/validation `TokenCorpus` pair as the in-memory
path, whose `tokens` read from the cache. Windows, packing, the split and the
order then run the same code, so batches are bitwise those of the in-memory
path while memory holds only the document offsets.

Layout (zarr v3 arrays; chunks zstd-compressed with a crc32c checksum; a chunk
file of `tokens` holds blocks of `read_block_tokens` compressed one by one):

  tokens/          uint16 or int32 [num_tokens]: every document's ids, back to back
  doc_offsets/     int64 [num_documents + 1]: document d is tokens[o[d]:o[d + 1]]
  doc_digests/     uint8 [num_documents, 16]: the hash each document's chunks are
                   split by (`corpus.document_digest`), so one cache serves any
                   `validation_fraction` and `split_chunk_tokens`
  identity.json    what the cache is of (tokenizer, source files, settings, layout)
  shards/NNNNN.json  one per committed shard of documents: its document and token range
  manifest.json    identity plus counts; written last, so its presence means complete

Crash safety: a shard's chunks are written first, then its ledger file
`shards/NNNNN.json` atomically; only then is the shard committed. A rerun
continues after the last committed shard and rewrites whatever a killed run
had written beyond it with the same bytes (a chunk's bytes depend on its
contents alone), so it ends byte-identical to an uninterrupted run.

Workers: with `workers=N` (`data prepare --workers N`) this process reads
the documents and N spawned processes tokenize them, a shard per task; shards
are written strictly in order, so the cache is byte-identical to one of a
single process, and at most 2N shards are in flight, so memory stays bounded.

`location` is a directory or a TensorStore kvstore URL (`file://`,
`memory://`, ...). Local files are replaced with `atomic.write_atomically`;
other kvstores write each key atomically themselves.

Example: two text files tokenized (byte tokenizer: BOS 256, EOS 257) into a cache.
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> config = DataConfig(source="text", paths=("*.txt",))
  >>> prepare(config, "cache", progress=False).num_tokens
  12
  >>> cache = TokenCache.open("cache", config)
  >>> cache.doc_offsets().tolist(), cache.read(0, 5).tolist()
  ([0, 5, 12], [256, 97, 98, 99, 257])
  >>> corpora = load_cached_corpus(dataclasses.replace(config, cache="cache"))
  >>> corpora["train"].num_tokens + corpora["validation"].num_tokens
  12
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import resource_tracker

import numpy as np
import tensorstore as ts

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.config import DataConfig, require_token_source
from jax_ai_stack.recipes.data.tokenizers import Tokenizer, build_tokenizer

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
IDENTITY = "identity.json"
DEFAULT_CHUNK_TOKENS = 1 << 18  # 512 KiB of uint16 per chunk file before compression
READ_BLOCK_TOKENS = 1 << 12
"""Tokens per independently compressed block inside a chunk file of `tokens`: a
batch window decompresses one or two 8 KiB blocks, not its whole chunk (zarr3's
`sharding_indexed` codec; 2.3x the random-window read speed in benchmarks/token_cache.py)."""
DEFAULT_SHARD_DOCUMENTS = 1024
_DIGEST_BYTES = 16
_HASH_BLOCK = 1 << 20
# One context for every open: a memory:// cache is then shared within the process.
_CONTEXT = ts.Context()
_CODECS = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
    {"name": "crc32c"},
]


def _read_block(chunk_tokens: int, read_block_tokens: int) -> int:
  """`read_block_tokens` where it divides the chunk; else the chunk is one block."""
  return read_block_tokens if chunk_tokens % read_block_tokens == 0 else chunk_tokens


def _token_codecs(block_tokens: int) -> list[dict]:
  return [{"name": "sharding_indexed", "configuration": {
      "chunk_shape": [block_tokens],
      "codecs": _CODECS,
      "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
      "index_location": "end",
  }}]


# -- where a cache lives ------------------------------------------------------


class _Location:
  """A local directory, or a kvstore URL; reads and writes small files and names arrays."""

  def __init__(self, where: str | os.PathLike):
    self.where = str(where)
    path = self.where[len("file://"):] if self.where.startswith("file://") else self.where
    self.local = None if "://" in path else pathlib.Path(path)
    self._kvstore = None

  @property
  def kvstore(self) -> ts.KvStore:
    if self._kvstore is None:
      self._kvstore = ts.KvStore.open(self._spec(""), context=_CONTEXT).result()
    return self._kvstore

  def _spec(self, name: str) -> dict:
    if self.local is not None:
      return {"driver": "file", "path": f"{self.local.resolve()}/{name}"}
    spec = ts.KvStore.Spec(self.where).to_json()
    base = spec.get("path", "")
    spec["path"] = (base if not base or base.endswith("/") else base + "/") + name
    return spec

  def array_spec(self, name: str) -> dict:
    return self._spec(name + "/")

  def read(self, name: str) -> bytes | None:
    if self.local is not None:
      try:
        return (self.local / name).read_bytes()
      except FileNotFoundError:
        return None
      except OSError as e:
        raise DataError(f"token cache {self.where}: cannot read {name}: {e}") from None
    result = self.kvstore.read(name).result()
    return result.value if result.state == "value" else None

  def write(self, name: str, data: bytes) -> None:
    if self.local is not None:
      (self.local / name).parent.mkdir(parents=True, exist_ok=True)
      write_atomically(self.local / name, data)
    else:
      self.kvstore.write(name, data).result()

  def keys(self, prefix: str) -> set[str]:
    """The keys under `prefix` (e.g. "tokens/c/"), relative to the cache."""
    if self.local is not None:
      root = self.local / prefix
      if not root.is_dir():
        return set()
      return {
          (prefix + p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file()
      }
    keys = self.kvstore.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord("/") + 1)))
    return {k.decode() for k in keys.result()}

  def make_writable(self) -> None:
    """Creates the directory, or raises `DataError` if it cannot hold a cache."""
    if self.local is None:
      return
    if self.local.exists() and not self.local.is_dir():
      raise DataError(f"--cache / data.cache={self.where}: is a file, not a directory")
    try:
      self.local.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise DataError(f"--cache / data.cache={self.where}: cannot create it: {e}") from None
    if not os.access(self.local, os.W_OK | os.X_OK):
      raise DataError(f"--cache / data.cache={self.where}: the directory is not writable")


def _read_json(location: _Location, name: str) -> dict | None:
  data = location.read(name)
  if data is None:
    return None
  try:
    return json.loads(data)
  except ValueError:
    raise DataError(
        f"token cache {location.where}: {name} is not valid JSON; delete the cache and"
        " prepare it again"
    ) from None


def _to_json(value: dict) -> bytes:
  return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


# -- what a cache is of ----------------------------------------------------------


def _file_hash(path: pathlib.Path) -> str:
  digest = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    while block := f.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def _source_files(config: DataConfig) -> list[pathlib.Path]:
  if config.source == "stdlib":
    return sources.stdlib_files(config.paths)
  return sources.resolve_paths(config.paths)


def _file_entries(files: list[pathlib.Path], recorded: list[dict] | None = None) -> list[dict]:
  """Path, size, mtime and content hash of each file.

  A file whose size and mtime match its `recorded` entry keeps the recorded
  hash, so opening a cache does not re-read the corpus.
  """
  known = {entry["path"]: entry for entry in recorded or ()}
  entries = []
  for path in files:
    stat = path.stat()
    entry = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    old = known.get(str(path))
    if old and (old["size"], old["mtime_ns"]) == (entry["size"], entry["mtime_ns"]):
      entry["blake2b"] = old["blake2b"]
    else:
      entry["blake2b"] = _file_hash(path)
    entries.append(entry)
  return entries


def _tokenizer_identity(config: DataConfig, tokenizer: Tokenizer) -> dict:
  """What defines the ids: the kind, the file's hash (not its path) and the special ids."""
  identity = {
      "name": config.tokenizer,
      "vocab_size": tokenizer.vocab_size,
      "bos_id": tokenizer.bos_id,
      "eos_id": tokenizer.eos_id,
      "pad_id": tokenizer.pad_id,
  }
  if config.tokenizer != "byte":
    identity["file_blake2b"] = _file_hash(pathlib.Path(config.tokenizer_path))
  return identity


def _settings(config: DataConfig) -> dict:
  return {
      "source": config.source,
      "text_column": config.text_column,
      "encoding_errors": config.encoding_errors,
      "max_documents": config.max_documents,
  }


def _identity(config, tokenizer, *, chunk_tokens, shard_documents,
              read_block_tokens=READ_BLOCK_TOKENS, recorded=None) -> dict:
  return {
      "format_version": FORMAT_VERSION,
      "tokenizer": _tokenizer_identity(config, tokenizer),
      "settings": _settings(config),
      "sources": _file_entries(_source_files(config), recorded),
      "layout": {
          "chunk_tokens": chunk_tokens,
          "read_block_tokens": _read_block(chunk_tokens, read_block_tokens),
          "shard_documents": shard_documents,
          "dtype": corpus_lib.token_dtype(tokenizer).name,
      },
  }


def _check_version(where: str, recorded: dict) -> None:
  version = recorded.get("format_version")
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise DataError(
        f"token cache {where}: format version {version} is newer than this jax-ai-stack"
        f" reads (format version {FORMAT_VERSION}); upgrade jax-ai-stack or prepare a"
        " new cache"
    )


def _differences(recorded: dict, current: dict, *, prefix_ok: bool) -> list[str]:
  """What differs between a cache's identity and the config's, one phrase each."""
  found = []
  if recorded["tokenizer"] != current["tokenizer"]:
    found.append(
        f"data.tokenizer: the cache was tokenized with {recorded['tokenizer']}, the config"
        f" gives {current['tokenizer']}"
    )
  for field, old in recorded["settings"].items():
    new = current["settings"][field]
    # A cache of all documents serves any max_documents: it reads a prefix.
    if field == "max_documents" and prefix_ok and (old is None or (new is not None and new <= old)):
      continue
    if old != new:
      found.append(f"data.{field}: the cache has {old!r}, the config {new!r}")
  old_files = {e["path"]: e for e in recorded["sources"]}
  new_files = {e["path"]: e for e in current["sources"]}
  for path in new_files.keys() - old_files.keys():
    found.append(f"source file {path} is not in the cache")
  for path in old_files.keys() - new_files.keys():
    found.append(f"source file {path} is in the cache but no longer in data.paths")
  for path in old_files.keys() & new_files.keys():
    old, new = old_files[path], new_files[path]
    if old["size"] != new["size"]:
      found.append(f"source file {path} changed: {old['size']} bytes then, {new['size']} now")
    elif old["blake2b"] != new["blake2b"]:
      found.append(f"source file {path} changed: its content hash differs")
  same_files = old_files.keys() == new_files.keys()
  if same_files and list(old_files) != list(new_files):
    found.append("data.paths: the source files are in another order")
  return found


@dataclasses.dataclass(frozen=True)
class Manifest:
  """`manifest.json`: the cache's identity, its layout and its counts."""

  format_version: int
  tokenizer: dict
  settings: dict
  sources: list
  layout: dict
  num_documents: int
  num_tokens: int
  num_shards: int

  @classmethod
  def from_json(cls, where: str, value: dict) -> Manifest:
    _check_version(where, value)
    try:
      return cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})
    except KeyError as e:
      raise DataError(f"token cache {where}: {MANIFEST} lacks the field {e}") from None

  def identity(self) -> dict:
    return {k: getattr(self, k) for k in ("format_version", "tokenizer", "settings",
                                          "sources", "layout")}

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.layout["dtype"])


# -- writing ---------------------------------------------------------------------


def _open_array(location: _Location, name: str, *, create: bool, dtype=None,
                chunk_shape=None, inner=(), codecs=_CODECS) -> ts.TensorStore:
  spec = {
      "driver": "zarr3",
      "kvstore": location.array_spec(name),
      # Chunks of fill value are stored too, so a missing chunk always means damage.
      "store_data_equal_to_fill_value": True,
  }
  # Reopened as it is when it exists: tensorstore refuses `create` metadata whose
  # shape differs from the stored one, even with `open=True`.
  create = create and location.read(f"{name}/zarr.json") is None
  if create:
    spec["metadata"] = {
        "shape": [0, *inner],
        "data_type": np.dtype(dtype).name,
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": [chunk_shape, *inner]}},
        "codecs": codecs,
        "fill_value": 0,
    }
  try:
    return ts.open(spec, open=True, create=create, context=_CONTEXT).result()
  except ValueError as e:
    raise DataError(f"token cache {location.where}: cannot open array {name!r}: {e}") from None


def _grow(array: ts.TensorStore, size: int) -> ts.TensorStore:
  if array.shape[0] < size:
    array = array.resize(exclusive_max=[size, *array.shape[1:]], expand_only=True).result()
  return array


@dataclasses.dataclass(frozen=True)
class _Shard:
  """One shard's documents as the arrays store them (what a worker sends back)."""

  lengths: np.ndarray  # int64 [documents]
  tokens: np.ndarray  # the cache's dtype [sum(lengths)]
  digests: np.ndarray  # uint8 [documents, 16]


def _pack(documents: list[tuple[bytes, np.ndarray]], dtype: np.dtype) -> _Shard:
  return _Shard(
      lengths=np.array([len(ids) for _, ids in documents], dtype=np.int64),
      tokens=np.concatenate([ids for _, ids in documents]).astype(dtype),
      digests=np.frombuffer(
          b"".join(corpus_lib.document_digest(content) for content, _ in documents), np.uint8
      ).reshape(-1, _DIGEST_BYTES),
  )


# Each worker process's tokenizer, built once there by `_start_worker`.
_worker_tokenizer: Tokenizer | None = None


@contextlib.contextmanager
def _deaf_to_ctrl_c():
  """Processes started in the block never see SIGINT; here it waits until the block ends.

  Ctrl-C reaches the terminal's whole process group: the parent answers it (one
  line, exit 130) and its workers end with it (`_exit_without`), but a worker
  interrupted, even while still importing, would print its own traceback. A
  blocked signal mask is inherited through fork and exec; Python's handler in
  this process runs once the block ends.
  """
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_quiet_resource_tracker() -> None:
  """multiprocessing's resource tracker, without its warning after a Ctrl-C.

  It outlives a prepare stopped by Ctrl-C by a moment and warns about the pool's
  semaphores, which it then removes itself; its flags come from
  `sys.warnoptions` when it starts. Nothing happens if it is already running.
  """
  saved = sys.warnoptions[:]
  sys.warnoptions.append("ignore:resource_tracker:UserWarning")
  try:
    resource_tracker.ensure_running()
  finally:
    sys.warnoptions[:] = saved


def _start_worker(config: DataConfig, parent: int) -> None:
  global _worker_tokenizer
  _worker_tokenizer = build_tokenizer(config)
  threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()


def _exit_without(parent: int) -> None:
  """Ends this worker once `parent` is gone: a killed prepare leaves no orphans
  (workers hold both ends of their task queue, so they never see it close)."""
  while os.getppid() == parent:
    time.sleep(0.5)
  os._exit(1)


def _tokenize_shard(texts: list[str], dtype: np.dtype) -> _Shard:
  return _pack(corpus_lib.tokenize_texts(_worker_tokenizer, texts), dtype)


def _shards(config: DataConfig, tokenizer: Tokenizer, *, skip: int, shard_documents: int,
            workers: int) -> Iterator[_Shard]:
  """The shards after the first `skip` documents, in order, tokenized in `workers` processes.

  Worker processes are spawned, not forked: TensorStore's threads are running
  here. `.npy` sources need no tokenizing and are read here whatever `workers`.
  """
  dtype = corpus_lib.token_dtype(tokenizer)
  if workers == 1 or config.source == "npy":
    documents = corpus_lib.tokenized_documents(config, tokenizer, skip=skip)
    while batch := list(itertools.islice(documents, shard_documents)):
      yield _pack(batch, dtype)
    return
  texts = corpus_lib.document_texts(config, skip=skip)
  with _deaf_to_ctrl_c():
    _start_quiet_resource_tracker()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(config, os.getpid()))
  pending = collections.deque()
  try:
    while True:
      while len(pending) < 2 * workers and (batch := list(itertools.islice(texts,
                                                                           shard_documents))):
        with _deaf_to_ctrl_c():  # The pool starts its workers here.
          pending.append(pool.submit(_tokenize_shard, batch, dtype))
      if not pending:
        return
      yield pending.popleft().result()
  finally:
    pool.shutdown(cancel_futures=True)


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


def _progress(total_docs: int, initial: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(desc="tokenize", unit="doc", initial=initial, total=total_docs or None,
              file=sys.stderr, disable=not enabled, dynamic_ncols=True)


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
    with _progress(config.max_documents or 0, num_docs, progress) as bar:
      for packed in itertools.chain([first] if first is not None else [], shards):
        end_doc, end_token = writer.write_shard(num_docs, num_tokens, packed)
        if on_shard:
          on_shard(shard, "written")
        location.write(_shard_name(shard), _to_json(
            {"documents": [num_docs, end_doc], "tokens": [num_tokens, end_token]}))
        if on_shard:
          on_shard(shard, "committed")
        new_tokens += end_token - num_tokens
        bar.update(end_doc - num_docs)
        bar.set_postfix_str(f"{new_tokens / max(time.monotonic() - start, 1e-9):,.0f} tokens/s")
        shard, num_docs, num_tokens = shard + 1, end_doc, end_token
  writer.finish(num_docs, num_tokens)
  manifest = Manifest(**identity, num_documents=num_docs, num_tokens=num_tokens,
                      num_shards=shard)
  location.write(MANIFEST, _to_json(dataclasses.asdict(manifest)))
  return manifest


def _refuse_differences(where: str, recorded: dict, current: dict, *, prefix_ok: bool,
                        unfinished: bool = False) -> None:
  found = _differences(recorded, current, prefix_ok=prefix_ok)
  if not unfinished and recorded["layout"]["dtype"] != current["layout"]["dtype"]:
    found.append(f"token dtype {recorded['layout']['dtype']} != {current['layout']['dtype']}")
  if unfinished and recorded["layout"] != current["layout"]:
    found.append(f"layout: the cache has {recorded['layout']}, this run {current['layout']}")
  if found:
    what = "an unfinished cache" if unfinished else "a cache"
    raise DataError(
        f"token cache {where} is {what} of another corpus: {'; '.join(found)}. Use"
        " another data.cache (--cache), or delete it to prepare it again")


# -- reading ---------------------------------------------------------------------


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
  """The train/validation `TokenCorpus` pair `corpus.load_corpus` would build, read from `cache`."""
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
  """`load_corpus` for `data.cache`: prepares the cache if it has no manifest, then reads it.

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

