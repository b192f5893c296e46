"""What a token cache is of: its tokenizer, source files, settings and layout; its manifest.

A cache records its identity (`identity.json`) before its first shard and its
`Manifest` (identity plus counts) last. Opening or resuming one compares that
identity with the config's and refuses, naming each difference, a cache of
another corpus; a source file whose size and mtime are unchanged keeps its
recorded hash, so that check does not re-read the corpus.

Example:
  >>> from jax_ai_stack.recipes.data import build_tokenizer
  >>> _ = open("a.txt", "w").write("abc")
  >>> config = DataConfig(source="text", paths=("a.txt",))
  >>> ids = _identity(config, build_tokenizer(config), chunk_tokens=64, shard_documents=8)
  >>> ids["layout"], [e["size"] for e in ids["sources"]]
  ({'chunk_tokens': 64, 'read_block_tokens': 64, 'shard_documents': 8, 'dtype': 'uint16'}, [3])
  >>> _ = open("a.txt", "w").write("abcd")
  >>> now = _identity(config, build_tokenizer(config), chunk_tokens=64, shard_documents=8)
  >>> _differences(ids, now, prefix_ok=True)
  ['source file a.txt changed: 3 bytes then, 4 now']
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import numpy as np

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data import sources
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.token_cache.store import READ_BLOCK_TOKENS, _read_block
from jax_ai_stack.recipes.data.tokenizers import Tokenizer

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
IDENTITY = "identity.json"
_HASH_BLOCK = 1 << 20


def _file_hash(path: pathlib.Path) -> str:
  digest = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    while block := f.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def file_entries(files: list[pathlib.Path], recorded: list[dict] | None = None) -> list[dict]:
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
      "sources": file_entries(sources.source_files(config), recorded),
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

