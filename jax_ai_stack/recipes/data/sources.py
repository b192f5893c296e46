"""Where documents come from: the stdlib corpus, text, .npy, ArrayRecord, Parquet, digits.

Every reader yields `(name, document)` pairs in a fixed order (sorted files,
records in file order), where `name` says where the document came from so that
errors can point at it. Text documents are `str`; `.npy` documents are int
arrays that are already tokenized.

Text policy: files are read as bytes and decoded as UTF-8 with
`DataConfig.encoding_errors`: "replace" (default) substitutes U+FFFD for each
invalid byte, "ignore" drops it, "strict" raises an error naming the file and
byte offset. A file of the user's (each text file; all records of an
ArrayRecord or Parquet file together) that holds NUL bytes or more than 10%
invalid UTF-8 is not text: an error names it, since training on the U+FFFD
left of a binary file is never what was meant. Fewer invalid bytes are
replaced with one warning per file saying how many. The stdlib corpus is
trusted (a few of its test modules are deliberately in other encodings).

One text file is one document; one ArrayRecord record or one Parquet row is
one document.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

from jax_ai_stack.errors import ConfigError, DataError, MissingExtraError
from jax_ai_stack.recipes.data.config import STDLIB_SOURCES, DataConfig

log = logging.getLogger(__name__)

_GLOB_CHARS = frozenset("*?[")
# More invalid UTF-8 than this share of a file's bytes: it is not text. Latin-1
# prose has a few percent; random or compressed bytes about half.
_MAX_INVALID_SHARE = 0.1


class DataFileNotFoundError(DataError, FileNotFoundError):
  """A data or tokenizer file that does not exist: a user error, and still a FileNotFoundError."""


def resolve_paths(patterns: tuple[str, ...]) -> list[pathlib.Path]:
  """Files named by `patterns` (paths or globs), sorted within each pattern.

  Raises:
    DataFileNotFoundError: a path does not exist or a glob matches no file.
  """
  files: list[pathlib.Path] = []
  for i, pattern in enumerate(patterns):
    if _GLOB_CHARS.intersection(pattern):
      matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
      if not matches:
        raise DataFileNotFoundError(f"data.paths[{i}]={pattern!r}: the glob matches no file")
      files.extend(pathlib.Path(p) for p in matches)
    elif os.path.isfile(pattern):
      files.append(pathlib.Path(pattern))
    else:
      raise DataFileNotFoundError(f"data.paths[{i}]={pattern!r}: no such file")
  return list(dict.fromkeys(files))  # drop repeats, keep the order


def source_files(config: DataConfig) -> list[pathlib.Path]:
  """The files a source reads: the standard library's, or `paths` (none for the sources
  made on the fly: arithmetic, digits)."""
  if config.source in STDLIB_SOURCES:
    return stdlib_files(config.paths)
  return resolve_paths(config.paths)


def stdlib_root() -> pathlib.Path:
  """Where this Python's standard library lives."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(patterns: tuple[str, ...] = ()) -> list[pathlib.Path]:
  """The standard library's own .py files, sorted, without site-/dist-packages.

  `patterns` (`data.paths` of the stdlib source): keep only the files whose
  path relative to the stdlib root matches one (fnmatch, e.g. "logging/*"),
  so a recipe can name one package, wherever Python is installed.

  Raises:
    DataFileNotFoundError: a pattern matches no file.
  """
  root = stdlib_root()
  files = []
  for directory, subdirs, names in os.walk(root):  # os.walk does not follow symlinks
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
    files.extend(pathlib.Path(directory, n) for n in names if n.endswith(".py"))
  files.sort(key=lambda p: p.relative_to(root).as_posix())
  if not patterns:
    return files
  names = [p.relative_to(root).as_posix() for p in files]
  for i, pattern in enumerate(patterns):
    if not fnmatch.filter(names, pattern):
      raise DataFileNotFoundError(
          f"data.paths[{i}]={pattern!r}: no file of the standard library ({root}) matches")
  return [p for p, n in zip(files, names) if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def invalid_utf8_bytes(data: bytes) -> int:
  r"""How many bytes of `data` are not UTF-8: the ones errors="ignore" drops.

  Example:
    >>> invalid_utf8_bytes("héllo".encode()), invalid_utf8_bytes(b"h\xe9llo\xff")
    (0, 2)
  """
  return len(data) - len(data.decode("utf-8", "ignore").encode("utf-8"))


def decode_text(data: bytes, name: str, errors: str) -> tuple[str, int]:
  """UTF-8 text of `data` under the `errors` policy, and how many bytes were invalid.

  Raises:
    DataError: errors="strict" and `data` is not valid UTF-8: names `name` and
      the byte, or says that it is not text at all.
  """
  try:
    return data.decode("utf-8"), 0
  except UnicodeDecodeError as e:
    invalid = invalid_utf8_bytes(data)
    if errors != "strict":
      return data.decode("utf-8", errors), invalid
    if _is_binary(len(data), invalid, data.count(0)):
      raise _not_text(name, len(data), invalid, data.count(0), "found") from None
    raise DataError(
        f"{name}: invalid UTF-8 at byte {e.start} ({e.reason}); set"
        " data.encoding_errors='replace' or 'ignore' to read it anyway"
    ) from None


def _is_binary(size: int, invalid: int, nul: int) -> bool:
  return bool(nul) or invalid > _MAX_INVALID_SHARE * size


def _not_text(name: str, size: int, invalid: int, nul: int, verb: str) -> DataError:
  nul_note = f", {nul} NUL bytes" if nul else ""
  return DataError(
      f"data.paths: {name} is not UTF-8 text ({invalid} of {size} bytes {verb}{nul_note});"
      " remove it from data.paths or convert it to UTF-8"
  )


def check_text(name: str, size: int, invalid: int, nul: int, errors: str) -> None:
  """Raises if a file of `size` bytes is binary; else warns how many bytes were replaced.

  Raises:
    DataError: the file holds NUL bytes or more than 10% invalid UTF-8.
  """
  verb = "dropped" if errors == "ignore" else "replaced"
  if _is_binary(size, invalid, nul):
    raise _not_text(name, size, invalid, nul, verb)
  if invalid:
    log.warning("data.paths: %s: %d of %d bytes are not UTF-8 and were %s"
                " (data.encoding_errors=%r)", name, invalid, size, verb, errors)


def _read_files(
    files: list[pathlib.Path], errors: str, *, trusted: bool = False
) -> Iterator[tuple[str, str]]:
  for path in files:
    data = path.read_bytes()
    text, invalid = decode_text(data, str(path), errors)
    if not trusted:
      check_text(str(path), len(data), invalid, data.count(0), errors)
    yield str(path), text


class _FileText:
  """Bytes, invalid bytes and NULs summed over one file's records, for `check_text`."""

  def __init__(self, path: pathlib.Path, errors: str):
    self.path, self.errors = path, errors
    self.size = self.invalid = self.nul = 0

  def decode(self, record: bytes, name: str) -> str:
    text, invalid = decode_text(record, name, self.errors)
    self.size += len(record)
    self.invalid += invalid
    self.nul += record.count(0)
    return text

  def check(self) -> None:
    check_text(str(self.path), self.size, self.invalid, self.nul, self.errors)


def _read_arrayrecord(files: list[pathlib.Path], errors: str) -> Iterator[tuple[str, str]]:
  import grain  # pylint: disable=g-import-not-at-top

  for path in files:
    try:
      records = grain.sources.ArrayRecordDataSource([str(path)])
      count = len(records)
    except Exception as e:  # the reader raises several types for a bad file
      raise DataError(f"data.paths: {path}: not a readable ArrayRecord file: {e}") from None
    text = _FileText(path, errors)
    for start in range(0, count, 1024):
      chunk = records.__getitems__(range(start, min(start + 1024, count)))
      for offset, record in enumerate(chunk):
        name = f"{path}[record {start + offset}]"
        yield name, text.decode(record, name)
    text.check()


def _read_parquet(
    files: list[pathlib.Path], column: str, errors: str
) -> Iterator[tuple[str, str]]:
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingExtraError(
        "data.source='parquet' needs pyarrow: pip install 'jax-ai-stack[parquet]'"
    ) from None
  for path in files:
    try:
      schema = pq.read_schema(path)
    except pa.ArrowException as e:
      raise DataError(f"data.paths: {path}: not a readable Parquet file: {e}") from None
    if column not in schema.names:
      raise DataError(
          f"{path}: no column {column!r} (data.text_column); its columns are"
          f" {', '.join(schema.names)}"
      )
    kind = schema.field(column).type
    textual = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
               pa.types.is_large_binary)
    if not any(is_type(kind) for is_type in textual):
      raise DataError(
          f"{path}: column {column!r} (data.text_column) holds {kind}, not text"
      )
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    text = _FileText(path, errors)
    for row, value in enumerate(values):
      name = f"{path}[row {row}]"
      if isinstance(value, bytes):
        value = text.decode(value, name)
      yield name, value or ""  # a null cell is an empty document
    text.check()


def read_texts(config: DataConfig) -> Iterator[tuple[str, str]]:
  """`(name, text)` of each document of a text source, in source order."""
  if config.source == "stdlib":
    return _read_files(stdlib_files(config.paths), config.encoding_errors, trusted=True)
  files = resolve_paths(config.paths)
  if config.source == "text":
    return _read_files(files, config.encoding_errors)
  if config.source == "arrayrecord":
    return _read_arrayrecord(files, config.encoding_errors)
  if config.source == "parquet":
    return _read_parquet(files, config.text_column, config.encoding_errors)
  raise ConfigError(f"data.source={config.source!r} is not a text source")


def count_documents(config: DataConfig) -> int | None:
  """At most how many documents a source yields, where that is known without reading
  it: one a file (stdlib, text; empty files yield none), capped by max_documents.
  None where a file holds many (npy, arrayrecord, parquet) and no cap is set."""
  if config.source == "stdlib":
    files = len(stdlib_files(config.paths))
  elif config.source == "text":
    files = len(resolve_paths(config.paths))
  else:
    return config.max_documents
  return files if config.max_documents is None else min(files, config.max_documents)


def read_token_arrays(
    config: DataConfig, vocab_size: int, eos_id: int
) -> Iterator[tuple[str, np.ndarray]]:
  """`(name, ids)` of each document in the `.npy` files, split after each EOS.

  Each file is a 1-D integer array of any integer dtype, memory-mapped; the
  token stream is cut into documents after every `eos_id` (EOS stays with the
  document it ends). Nothing is added: the ids are used as they are.

  Raises:
    DataError: a file is not 1-D integer data, or holds an id outside
      [0, vocab_size) (the message names the file, the id and its index).
  """
  for path in resolve_paths(config.paths):
    try:
      array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
      raise DataError(f"data.paths: {path}: not a readable .npy array: {e}") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
      raise DataError(
          f"{path}: expected a 1-D integer token array, got {array.dtype} of shape"
          f" {array.shape}"
      )
    if array.size == 0:
      continue
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
      raise DataError(
          f"{path}: token id {int(array[bad[0]])} at index {int(bad[0])} is outside the"
          f" vocabulary [0, {vocab_size}) of data.tokenizer; {bad.size} ids are out of"
          " range"
      )
    ends = np.flatnonzero(array == eos_id) + 1
    bounds = np.concatenate([[0], ends[ends < array.size], [array.size]])
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
      yield f"{path}[document {i}]", array[start:stop]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's bundled digits: float32 images [N, 8, 8, 1] in [0, 1], int32 labels."""
  try:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise MissingExtraError(
        "data.source='digits' needs scikit-learn: pip install 'jax-ai-stack[digits]'"
    ) from None
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  return images, digits.target.astype(np.int32)
