"""Where documents come from: the stdlib corpus, text, .npy, ArrayRecord, Parquet, digits.

Every reader yields `(name, document)` pairs in a fixed order (sorted files,
records in file order), where `name` says where the document came from so that
errors can point at it. Text documents are `str`; `.npy` documents are int
arrays that are already tokenized.

Text policy: files are read as bytes and decoded as UTF-8 with
`DataConfig.encoding_errors`: "replace" (default) substitutes U+FFFD for each
invalid byte, "ignore" drops it, "strict" raises an error naming the file and
byte offset. One text file is one document; one ArrayRecord record or one
Parquet row is one document.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

from jax_ai_stack.recipes.data.config import DataConfig

_GLOB_CHARS = frozenset("*?[")


def resolve_paths(patterns: tuple[str, ...]) -> list[pathlib.Path]:
  """Files named by `patterns` (paths or globs), sorted within each pattern.

  Raises:
    FileNotFoundError: a path does not exist or a glob matches no file.
  """
  files: list[pathlib.Path] = []
  for i, pattern in enumerate(patterns):
    if _GLOB_CHARS.intersection(pattern):
      matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
      if not matches:
        raise FileNotFoundError(f"data.paths[{i}]={pattern!r}: the glob matches no file")
      files.extend(pathlib.Path(p) for p in matches)
    elif os.path.isfile(pattern):
      files.append(pathlib.Path(pattern))
    else:
      raise FileNotFoundError(f"data.paths[{i}]={pattern!r}: no such file")
  return list(dict.fromkeys(files))  # drop repeats, keep the order


def stdlib_files() -> list[pathlib.Path]:
  """The standard library's own .py files, sorted, without site-/dist-packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = []
  for directory, subdirs, names in os.walk(root):  # os.walk does not follow symlinks
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
    files.extend(pathlib.Path(directory, n) for n in names if n.endswith(".py"))
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def decode_text(data: bytes, name: str, errors: str) -> str:
  """UTF-8 text of `data` under the `errors` policy; strict errors name `name`."""
  try:
    return data.decode("utf-8", errors=errors)
  except UnicodeDecodeError as e:
    raise ValueError(
        f"{name}: invalid UTF-8 at byte {e.start} ({e.reason}); set"
        " data.encoding_errors='replace' or 'ignore' to read it anyway"
    ) from None


def _read_files(files: list[pathlib.Path], errors: str) -> Iterator[tuple[str, str]]:
  for path in files:
    yield str(path), decode_text(path.read_bytes(), str(path), errors)


def _read_arrayrecord(files: list[pathlib.Path], errors: str) -> Iterator[tuple[str, str]]:
  import grain  # pylint: disable=g-import-not-at-top

  for path in files:
    try:
      records = grain.sources.ArrayRecordDataSource([str(path)])
      count = len(records)
    except Exception as e:  # the reader raises several types for a bad file
      raise ValueError(f"{path}: not a readable ArrayRecord file: {e}") from None
    for start in range(0, count, 1024):
      chunk = records.__getitems__(range(start, min(start + 1024, count)))
      for offset, record in enumerate(chunk):
        name = f"{path}[record {start + offset}]"
        yield name, decode_text(record, name, errors)


def _read_parquet(
    files: list[pathlib.Path], column: str, errors: str
) -> Iterator[tuple[str, str]]:
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        "data.source='parquet' needs pyarrow: pip install 'jax-ai-stack[parquet]'"
    ) from None
  for path in files:
    try:
      schema = pq.read_schema(path)
    except pa.ArrowException as e:
      raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    if column not in schema.names:
      raise ValueError(
          f"{path}: no column {column!r} (data.text_column); its columns are"
          f" {', '.join(schema.names)}"
      )
    kind = schema.field(column).type
    textual = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
               pa.types.is_large_binary)
    if not any(is_type(kind) for is_type in textual):
      raise ValueError(
          f"{path}: column {column!r} (data.text_column) holds {kind}, not text"
      )
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    for row, value in enumerate(values):
      name = f"{path}[row {row}]"
      if isinstance(value, bytes):
        value = decode_text(value, name, errors)
      yield name, value or ""  # a null cell is an empty document


def read_texts(config: DataConfig) -> Iterator[tuple[str, str]]:
  """`(name, text)` of each document of a text source, in source order."""
  if config.source == "stdlib":
    return _read_files(stdlib_files(), config.encoding_errors)
  files = resolve_paths(config.paths)
  if config.source == "text":
    return _read_files(files, config.encoding_errors)
  if config.source == "arrayrecord":
    return _read_arrayrecord(files, config.encoding_errors)
  if config.source == "parquet":
    return _read_parquet(files, config.text_column, config.encoding_errors)
  raise ValueError(f"data.source={config.source!r} is not a text source")


def read_token_arrays(
    config: DataConfig, vocab_size: int, eos_id: int
) -> Iterator[tuple[str, np.ndarray]]:
  """`(name, ids)` of each document in the `.npy` files, split after each EOS.

  Each file is a 1-D integer array of any integer dtype, memory-mapped; the
  token stream is cut into documents after every `eos_id` (EOS stays with the
  document it ends). Nothing is added: the ids are used as they are.

  Raises:
    ValueError: a file is not 1-D integer data, or holds an id outside
      [0, vocab_size) (the message names the file, the id and its index).
  """
  for path in resolve_paths(config.paths):
    try:
      array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
      raise ValueError(f"{path}: not a readable .npy array: {e}") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
      raise ValueError(
          f"{path}: expected a 1-D integer token array, got {array.dtype} of shape"
          f" {array.shape}"
      )
    if array.size == 0:
      continue
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
      raise ValueError(
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
    raise ImportError(
        "data.source='digits' needs scikit-learn: pip install 'jax-ai-stack[digits]'"
    ) from None
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  return images, digits.target.astype(np.int32)
