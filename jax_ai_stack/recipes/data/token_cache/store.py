"""Where a token cache lives: a directory or a kvstore URL, its small files and its arrays.

`_Location` reads and writes the cache's JSON files (atomically) and names its
arrays; `_open_array` opens or creates one zarr3 array there. One TensorStore
context serves every open, so a `memory://` cache is shared within the process.

Example:
  >>> location = _Location("cache")
  >>> location.make_writable()
  >>> location.write("notes/a.json", _to_json({"n": 1}))
  >>> _read_json(location, "notes/a.json"), sorted(location.keys("notes/"))
  ({'n': 1}, ['notes/a.json'])
  >>> array = _grow(_open_array(location, "ids", create=True, dtype="int64", chunk_shape=4), 6)
  >>> array.shape, _read_block(DEFAULT_CHUNK_TOKENS, READ_BLOCK_TOKENS)
  ((6,), 4096)
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import tensorstore as ts

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import DataError

DEFAULT_CHUNK_TOKENS = 1 << 18  # 512 KiB of uint16 per chunk file before compression
READ_BLOCK_TOKENS = 1 << 12
"""Tokens per independently compressed block inside a chunk file of `tokens`: a
batch window decompresses one or two 8 KiB blocks, not its whole chunk (zarr3's
`sharding_indexed` codec; 2.3x the random-window read speed in benchmarks/token_cache.py)."""
_DIGEST_BYTES = 16
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

