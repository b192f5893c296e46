"""Each source read end to end into a tokenized corpus; bad input names the file."""

from __future__ import annotations

import pathlib
import re
import sys
import sysconfig

import numpy as np
import pytest

from jax_ai_stack.errors import ConfigError, DataError, MissingExtraError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.data import DataConfig, load_corpus, load_digits, sources, stdlib_files
from jax_ai_stack.recipes.data.corpus import held_out_chunks

BOS, EOS = 256, 257


def _documents(corpus) -> list[bytes]:
  """Each document's bytes without its BOS/EOS frame."""
  docs = [corpus.document(i) for i in range(corpus.num_documents)]
  assert all(d[0] == BOS and d[-1] == EOS for d in docs)
  return [d[1:-1].astype(np.uint8).tobytes() for d in docs]


def _all_documents(config) -> list[bytes]:
  splits = load_corpus(config)
  return _documents(splits["train"]) + _documents(splits["validation"])


def _write_texts(directory: pathlib.Path, count: int) -> list[str]:
  texts = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(count)]
  for i, text in enumerate(texts):
    (directory / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
  return texts


def test_stdlib_files_are_sorted_python_sources_without_site_packages():
  files = stdlib_files()
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  relative = [f.relative_to(root).as_posix() for f in files]
  assert len(files) > 500 and relative == sorted(relative)
  assert all(r.endswith(".py") for r in relative)
  assert not any("site-packages" in r or "dist-packages" in r for r in relative)
  assert "os.py" in relative


def test_stdlib_corpus_holds_the_first_files_as_documents():
  config = DataConfig(max_documents=12, validation_fraction=0.0)
  docs = _documents(load_corpus(config)["train"])
  expected = [f.read_bytes() for f in stdlib_files()]
  expected = [e for e in expected if e][:12]  # empty files are skipped
  assert docs == expected


def test_text_files_and_globs(tmp_path):
  texts = _write_texts(tmp_path, 20)
  config = DataConfig(source="text", paths=(str(tmp_path / "doc00*.txt"),
                                            str(tmp_path / "doc019.txt")))
  docs = _all_documents(config)
  expected = [t.encode() for t in texts[:10] + [texts[19]]]
  assert sorted(docs) == sorted(expected)


TEXT = b"plain text around one bad byte: "


@pytest.mark.parametrize(
    "policy, expected", [("replace", TEXT + "ab\ufffdc".encode()), ("ignore", TEXT + b"abc")]
)
def test_invalid_utf8_follows_the_policy_and_says_how_many_bytes(tmp_path, caplog, policy,
                                                                  expected):
  (tmp_path / "bad.txt").write_bytes(TEXT + b"ab\xffc")
  config = DataConfig(source="text", paths=(str(tmp_path / "bad.txt"),),
                      encoding_errors=policy, validation_fraction=0.0)
  with caplog.at_level("WARNING"):
    assert _all_documents(config) == [expected]
  assert re.search(r"bad\.txt: 1 of 36 bytes are not UTF-8 and were (replaced|dropped)",
                   caplog.text)


def test_invalid_utf8_strict_names_the_file_and_byte(tmp_path):
  (tmp_path / "bad.txt").write_bytes(TEXT + b"abc\xff")
  config = DataConfig(source="text", paths=(str(tmp_path / "bad.txt"),),
                      encoding_errors="strict")
  with pytest.raises(DataError, match=r"bad\.txt: invalid UTF-8 at byte 35"):
    load_corpus(config)


@pytest.mark.parametrize("policy", ["replace", "ignore", "strict"])
def test_a_binary_file_is_named_as_not_text(tmp_path, policy):
  rng = np.random.default_rng(0)
  (tmp_path / "notes.bin").write_bytes(rng.integers(1, 256, 2000, dtype=np.uint8).tobytes())
  config = DataConfig(source="text", paths=(str(tmp_path / "notes.bin"),),
                      encoding_errors=policy)
  verb = {"replace": "replaced", "ignore": "dropped", "strict": "found"}[policy]
  with pytest.raises(DataError, match=rf"data\.paths: .*notes\.bin is not UTF-8 text \("
                                      rf"\d{{3,4}} of 2000 bytes {verb}\)"):
    load_corpus(config)


def test_nul_bytes_make_a_file_binary_even_when_it_decodes(tmp_path):
  (tmp_path / "utf16.txt").write_bytes("valid UTF-8, but UTF-16".encode("utf-16-le"))
  config = DataConfig(source="text", paths=(str(tmp_path / "utf16.txt"),))
  with pytest.raises(DataError, match=r"utf16\.txt is not UTF-8 text \(0 of 46 bytes"
                                      r" replaced, 23 NUL bytes\)"):
    load_corpus(config)


def test_the_stdlib_corpus_is_trusted_text():
  # A few stdlib test modules are in other encodings on purpose: no error, no warning.
  text = sources.read_texts(DataConfig())
  assert sum(1 for _ in text) == len(stdlib_files())


def test_a_glob_matching_nothing_is_named(tmp_path):
  config = DataConfig(source="text", paths=(str(tmp_path / "*.nothing"),))
  with pytest.raises(FileNotFoundError, match=r"data\.paths\[0\]=.*\*\.nothing.*matches no file"):
    load_corpus(config)
  config = DataConfig(source="text", paths=(str(tmp_path / "missing.txt"),))
  with pytest.raises(DataError, match=r"missing\.txt.*no such file") as raised:
    load_corpus(config)
  assert isinstance(raised.value, FileNotFoundError)  # both a user error and a missing file


def test_an_empty_corpus_is_an_error(tmp_path):
  (tmp_path / "a.txt").write_text("")
  (tmp_path / "b.txt").write_text("")
  config = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),))
  with pytest.raises(DataError, match=r"corpus is empty.*source='text'"):
    load_corpus(config)


def test_max_documents_caps_the_corpus(tmp_path):
  _write_texts(tmp_path, 20)
  config = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),), max_documents=5)
  splits = load_corpus(config)
  assert splits["train"].num_documents + splits["validation"].num_documents == 5


def test_split_is_by_document_content_not_order(tmp_path):
  texts = _write_texts(tmp_path, 200)
  config = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),), validation_fraction=0.2)
  held_out = set(_documents(load_corpus(config)["validation"]))
  # Each document is shorter than a chunk: it moves whole, by its own content.
  expected = {t.encode() for t in texts
              if held_out_chunks(t.encode(), len(t) + 2, 512, 0.2).tolist() == [True]}
  assert held_out == expected and 10 < len(held_out) < 80
  # Another order and extra documents move no document across the split.
  (tmp_path / "aaa_first.txt").write_text("a new document")
  for i in range(0, 200, 2):
    (tmp_path / f"doc{i:03d}.txt").rename(tmp_path / f"zzz{i:03d}.txt")
  held_out_again = set(_documents(load_corpus(config)["validation"]))
  assert held_out <= held_out_again
  assert held_out_again - held_out <= {b"a new document"}


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32, np.int64])
def test_npy_any_integer_dtype_split_into_documents_at_eos(tmp_path, dtype):
  np.save(tmp_path / "a.npy", np.array([5, 6, EOS, 7, EOS, 8, 9, 10], dtype=dtype))
  np.save(tmp_path / "b.npy", np.array([1, 2], dtype=dtype))
  config = DataConfig(source="npy", paths=(str(tmp_path / "*.npy"),), validation_fraction=0.0)
  corpus = load_corpus(config)["train"]
  docs = [corpus.document(i).tolist() for i in range(corpus.num_documents)]
  assert docs == [[5, 6, EOS], [7, EOS], [8, 9, 10], [1, 2]]  # nothing added


def test_npy_uint8_file_without_eos_is_one_document(tmp_path):
  np.save(tmp_path / "a.npy", np.array([5, 6, 7], dtype=np.uint8))
  config = DataConfig(source="npy", paths=(str(tmp_path / "a.npy"),), validation_fraction=0.0)
  assert load_corpus(config)["train"].tokens.tolist() == [5, 6, 7]


def test_npy_files_are_memory_mapped(tmp_path):
  np.save(tmp_path / "a.npy", np.array([5, 6, EOS, 7], dtype=np.int32))
  config = DataConfig(source="npy", paths=(str(tmp_path / "a.npy"),))
  documents = list(sources.read_token_arrays(config, vocab_size=259, eos_id=EOS))
  assert [name.endswith("a.npy[document 0]") for name, _ in documents] == [True, False]
  assert all(isinstance(doc, np.memmap) for _, doc in documents)


def test_npy_ids_outside_the_vocabulary_are_named(tmp_path):
  np.save(tmp_path / "big.npy", np.array([1, 2, 259, 3], dtype=np.int32))
  config = DataConfig(source="npy", paths=(str(tmp_path / "big.npy"),))
  with pytest.raises(DataError, match=r"big\.npy: token id 259 at index 2 .*\[0, 259\)"):
    load_corpus(config)
  np.save(tmp_path / "neg.npy", np.array([1, -1], dtype=np.int32))
  config = DataConfig(source="npy", paths=(str(tmp_path / "neg.npy"),))
  with pytest.raises(ValueError, match=r"neg\.npy: token id -1 at index 1"):
    load_corpus(config)


@pytest.mark.parametrize("array", [np.zeros((2, 3), np.int32), np.zeros(4, np.float32)])
def test_npy_must_be_1d_integers(tmp_path, array):
  np.save(tmp_path / "odd.npy", array)
  config = DataConfig(source="npy", paths=(str(tmp_path / "odd.npy"),))
  with pytest.raises(DataError, match=r"odd\.npy: expected a 1-D integer token array"):
    load_corpus(config)


def test_arrayrecord_records_are_documents(tmp_path):
  from array_record.python import array_record_module

  records = [b"first record", "zwei \u00fc".encode(), b"", b"bad \xff byte"]
  writer = array_record_module.ArrayRecordWriter(str(tmp_path / "a.arrayrecord"), "group_size:1")
  for record in records:
    writer.write(record)
  writer.close()
  config = DataConfig(source="arrayrecord", paths=(str(tmp_path / "a.arrayrecord"),),
                      validation_fraction=0.0)
  assert _all_documents(config) == [
      b"first record", "zwei \u00fc".encode(), "bad \ufffd byte".encode()]


def test_a_broken_arrayrecord_file_is_named(tmp_path):
  (tmp_path / "junk.arrayrecord").write_bytes(b"not an array record")
  config = DataConfig(source="arrayrecord", paths=(str(tmp_path / "junk.arrayrecord"),))
  with pytest.raises(DataError, match=r"junk\.arrayrecord: not a readable ArrayRecord file"):
    load_corpus(config)


def _write_parquet(path, **columns):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  pq.write_table(pa.table(columns), path)


def test_parquet_text_column_rows_are_documents(tmp_path):
  _write_parquet(tmp_path / "a.parquet", id=[1, 2, 3],
                 body=["row one", None, "row three"])
  config = DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),),
                      text_column="body", validation_fraction=0.0)
  assert _all_documents(config) == [b"row one", b"row three"]  # a null row is skipped


def test_parquet_without_the_column_is_named(tmp_path):
  _write_parquet(tmp_path / "a.parquet", body=["x"], id=[1])
  config = DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),))
  message = r"a\.parquet: no column 'text' \(data\.text_column\).*body, id"
  with pytest.raises(DataError, match=message):
    load_corpus(config)
  config = DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),), text_column="id")
  with pytest.raises(DataError, match=r"column 'id' .* holds int64, not text"):
    load_corpus(config)


def test_digits_images_and_labels():
  pytest.importorskip("sklearn")
  images, labels = load_digits()
  assert images.shape == (1797, 8, 8, 1) and images.dtype == np.float32
  assert images.min() == 0.0 and images.max() == 1.0
  assert labels.dtype == np.int32 and set(labels.tolist()) == set(range(10))


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now fails
  with pytest.raises(MissingExtraError, match=r"jax-ai-stack\[digits\]"):
    load_digits()


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
  (tmp_path / "a.parquet").write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  config = DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),))
  with pytest.raises(MissingExtraError, match=r"pyarrow.*jax-ai-stack\[parquet\]"):
    load_corpus(config)


def test_a_binary_parquet_column_is_named(tmp_path):
  _write_parquet(tmp_path / "blobs.parquet", text=[b"\x00\x01\x02\xff" * 10, b"ok"])
  config = DataConfig(source="parquet", paths=(str(tmp_path / "blobs.parquet"),))
  with pytest.raises(DataError, match=r"blobs\.parquet is not UTF-8 text \(10 of 42 bytes"
                                      r" replaced, 10 NUL bytes\)"):
    load_corpus(config)


def test_a_digits_config_has_no_token_corpus():
  with pytest.raises(ConfigError, match=r"data\.source='digits' is a labelled image set"):
    load_corpus(DataConfig(source="digits"))


@pytest.mark.parametrize("fields, message", [
    ({"source": "text"}, "needs at least one file"),
    ({"source": "digits", "paths": ["a.txt"]}, "reads no files"),
    ({"seq_len": 0}, "seq_len must be >= 1"),
    ({"validation_fraction": 1.0}, r"validation_fraction must be in \[0, 1\)"),
    ({"max_documents": 0}, "max_documents"),
    ({"split_chunk_tokens": 0}, "split_chunk_tokens must be >= 1"),
    ({"num_workers": -1}, "num_workers"),
    ({"source": "csv"}, "source"),
    ({"seq_length": 4}, "did you mean 'seq_len'"),
])
def test_bad_config_fields_are_named(fields, message):
  with pytest.raises(configlib.ConfigError, match=message):
    configlib.from_dict(DataConfig, fields)


def test_stdlib_paths_keep_one_package():
  files = stdlib_files(("json/*",))
  assert files and all(p.parent.name == "json" for p in files)
  assert len(stdlib_files()) > len(files)
  with pytest.raises(sources.DataFileNotFoundError, match=r"data\.paths\[0\]='nosuchpackage/\*'"):
    stdlib_files(("nosuchpackage/*",))
