"""The TensorStore token cache: same batches as in memory, resumable, refuses what does not fit."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from data_helpers import assert_same_batches as _assert_same
from data_helpers import read_batches
from jax_ai_stack import cli
from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.data import DataConfig, load_corpus, token_cache
from multidevice import run_program

# 4 compressed blocks per 64-token chunk, as in real caches: shard commits rewrite partly
# filled chunk files.
SMALL = {"shard_documents": 5, "chunk_tokens": 64, "read_block_tokens": 16, "progress": False}


@pytest.fixture
def corpus_dir(tmp_path):
  """23 text files of 5..600 characters (documents of several chunks each)."""
  rng = np.random.default_rng(0)
  letters = list("abcdefgh éz\n")
  directory = tmp_path / "corpus"
  directory.mkdir()
  for i in range(23):
    size = int(rng.integers(5, 600))
    (directory / f"doc{i:02d}.txt").write_text("".join(rng.choice(letters, size=size)))
  return directory


def _config(corpus_dir, **fields) -> DataConfig:
  base = {"source": "text", "paths": (str(corpus_dir / "*.txt"),), "seq_len": 16,
          "batch_size": 4, "split_chunk_tokens": 64, "validation_fraction": 0.3,
          "prefetch_batches": 0}
  return DataConfig(**{**base, **fields})


def _batches(config, split, count=None, **kwargs):
  return read_batches(config, count, split=split, **{"seed": 3, **kwargs})



def _tree(root: pathlib.Path) -> dict[str, bytes]:
  return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file()}


@pytest.mark.parametrize("packing", [False, True])
def test_cache_gives_the_in_memory_batches_bitwise(corpus_dir, tmp_path, packing):
  memory = _config(corpus_dir, packing=packing)
  cached = dataclasses.replace(memory, cache=str(tmp_path / "cache"))
  _assert_same(_batches(memory, "train", 40), _batches(cached, "train", 40))  # > 1 epoch
  validation = _batches(memory, "validation")
  assert validation
  _assert_same(validation, _batches(cached, "validation"))
  assert (tmp_path / "cache" / "manifest.json").is_file()  # prepared on first use


def test_split_corpora_equal_the_in_memory_ones(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  in_memory = load_corpus(config)
  cached = load_corpus(dataclasses.replace(config, cache=str(tmp_path / "cache")))
  for split in ("train", "validation"):
    tokens = cached[split].tokens
    assert len(tokens) == in_memory[split].num_tokens
    np.testing.assert_array_equal(cached[split].doc_starts, in_memory[split].doc_starts)
    np.testing.assert_array_equal(tokens[:], in_memory[split].tokens)
    np.testing.assert_array_equal(cached[split].document(1), in_memory[split].document(1))


def test_manifest_records_tokenizer_sources_and_counts(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  manifest = token_cache.prepare(config, tmp_path / "cache", **SMALL)
  on_disk = json.loads((tmp_path / "cache" / "manifest.json").read_text())
  assert on_disk["format_version"] == token_cache.FORMAT_VERSION
  assert on_disk["tokenizer"]["name"] == "byte"
  assert len(on_disk["sources"]) == 23 and {"size", "blake2b"} <= on_disk["sources"][0].keys()
  assert on_disk["num_documents"] == manifest.num_documents == 23
  assert on_disk["num_shards"] == 5
  memory = load_corpus(config)
  assert manifest.num_tokens == sum(c.num_tokens for c in memory.values())
  cache = token_cache.TokenCache.open(tmp_path / "cache", config)
  assert cache.num_tokens == manifest.num_tokens
  offsets = cache.doc_offsets()
  assert offsets[0] == 0 and offsets[-1] == cache.num_tokens and len(offsets) == 24
  assert cache.read(0, 1)[0] == 256  # BOS


def test_a_finished_cache_is_nothing_to_do(corpus_dir, tmp_path, capsys):
  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  before = _tree(tmp_path / "cache")
  token_cache.prepare(config, tmp_path / "cache", **{**SMALL, "progress": True})
  assert "nothing to do" in capsys.readouterr().err
  assert _tree(tmp_path / "cache") == before


@pytest.mark.parametrize("shard, stage", [(0, "committed"), (2, "written")])
def test_sigkill_during_prepare_then_rerun_is_byte_identical(corpus_dir, tmp_path, shard, stage):
  config = DataConfig(source="text", paths=(str(corpus_dir / "*.txt"),))
  token_cache.prepare(config, tmp_path / "reference", **SMALL)
  cache = tmp_path / "cache"
  killed = run_program("killed_prepare", corpus_dir / "*.txt", cache, [shard, stage], 1,
                       timeout=120)
  assert killed.returncode == -9, killed.stderr
  assert not (cache / "manifest.json").exists()
  assert (cache / "shards" / "00000.json").is_file()
  token_cache.prepare(config, cache, **SMALL)
  assert _tree(cache) == _tree(tmp_path / "reference")


def test_two_workers_give_the_same_bytes_as_one(corpus_dir, tmp_path):
  config = DataConfig(source="text", paths=(str(corpus_dir / "*.txt"),))
  token_cache.prepare(config, tmp_path / "one", **SMALL)
  manifest = token_cache.prepare(config, tmp_path / "two", **SMALL, workers=2)
  assert manifest.num_shards == 5  # several shards, more than 2 workers take at once
  assert _tree(tmp_path / "two") == _tree(tmp_path / "one")


def test_sigkill_then_rerun_with_workers_is_byte_identical(corpus_dir, tmp_path):
  config = DataConfig(source="text", paths=(str(corpus_dir / "*.txt"),))
  token_cache.prepare(config, tmp_path / "reference", **SMALL)
  cache = tmp_path / "cache"
  killed = run_program("killed_prepare", corpus_dir / "*.txt", cache, [1, "written"], 2,
                       timeout=120)
  assert killed.returncode == -9, killed.stderr
  token_cache.prepare(config, cache, **SMALL, workers=2)
  assert _tree(cache) == _tree(tmp_path / "reference")


def test_ctrl_c_during_prepare_with_workers_is_one_line_and_exit_130(corpus_dir, tmp_path):
  interrupted = run_program("interrupted_prepare", corpus_dir / "*.txt", tmp_path / "cache",
                            timeout=120, start_new_session=True)
  assert interrupted.returncode == 130, interrupted.stderr
  assert interrupted.stderr.strip().splitlines()[-1].endswith(  # After the bar, if any.
      "jax-ai-stack data: interrupted (Ctrl-C)")
  assert "Traceback" not in interrupted.stderr, interrupted.stderr


def test_another_tokenizer_is_refused_naming_it(corpus_dir, tmp_path):
  pytest.importorskip("tokenizers")
  from data_helpers import hf_tokenizer_file  # pylint: disable=g-import-not-at-top

  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  other = dataclasses.replace(config, tokenizer="huggingface",
                              tokenizer_path=hf_tokenizer_file(tmp_path))
  with pytest.raises(DataError, match=r"data\.tokenizer: the cache was tokenized with"):
    token_cache.TokenCache.open(tmp_path / "cache", other)


def test_a_changed_source_file_is_refused_naming_it(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  changed = corpus_dir / "doc07.txt"
  changed.write_text(changed.read_text() + "more")
  with pytest.raises(DataError, match=rf"source file {changed} changed: \d+ bytes then"):
    token_cache.TokenCache.open(tmp_path / "cache", config)
  same_size = corpus_dir / "doc08.txt"
  text = same_size.read_text()
  same_size.write_text(("b" if text[0] != "b" else "a") + text[1:])
  cached = dataclasses.replace(config, cache=str(tmp_path / "cache"))
  with pytest.raises(DataError, match=rf"source file {same_size} changed: its content hash"):
    load_corpus(cached)  # not re-prepared over: the existing cache is refused
  (corpus_dir / "doc99.txt").write_text("new")
  with pytest.raises(DataError, match=r"doc99.txt is not in the cache"):
    token_cache.TokenCache.open(tmp_path / "cache", config)


def test_a_corrupt_chunk_is_an_error_naming_it(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  chunk = tmp_path / "cache" / "tokens" / "c" / "3"
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0xFF
  chunk.unlink()
  chunk.write_bytes(bytes(data))
  cache = token_cache.TokenCache.open(tmp_path / "cache", config)
  cache.read(0, 64)  # chunk 0 is fine
  with pytest.raises(DataError, match=r"array 'tokens' is damaged: .*tokens/c/3"):
    cache.read(3 * 64, 4 * 64)  # Every block of chunk 3: one of them is damaged.
  chunk.write_bytes(bytes(data[: len(data) // 3]))  # truncated
  with pytest.raises(DataError, match=r"tokens/c/3"):
    token_cache.TokenCache.open(tmp_path / "cache").read(200, 201)
  chunk.unlink()
  with pytest.raises(DataError, match=r"array 'tokens' lacks chunk tokens/c/3"):
    token_cache.TokenCache.open(tmp_path / "cache")


def test_a_newer_format_is_refused_naming_both_versions(corpus_dir, tmp_path):
  config = _config(corpus_dir)
  token_cache.prepare(config, tmp_path / "cache", **SMALL)
  path = tmp_path / "cache" / "manifest.json"
  manifest = json.loads(path.read_text())
  path.write_text(json.dumps({**manifest, "format_version": 99}))
  message = rf"format version 99 is newer .* \(format version {token_cache.FORMAT_VERSION}\)"
  with pytest.raises(DataError, match=message):
    token_cache.TokenCache.open(tmp_path / "cache", config)
  with pytest.raises(DataError, match=message):
    token_cache.prepare(config, tmp_path / "cache", **SMALL)


def test_two_processes_read_disjoint_rows_of_the_global_batch(corpus_dir, tmp_path):
  config = _config(corpus_dir, cache=str(tmp_path / "cache"))
  whole = _batches(config, "train", 6)
  halves = [_batches(config, "train", 6, process_index=p, process_count=2) for p in (0, 1)]
  for step, batch in enumerate(whole):
    for key in batch:
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]), batch[key])


def test_a_memory_kvstore_cache(corpus_dir):
  memory = _config(corpus_dir)
  cached = dataclasses.replace(memory, cache="memory://token_cache_test/")
  _assert_same(_batches(memory, "train", 5), _batches(cached, "train", 5))


def test_cached_tokens_pickle_and_reopen(corpus_dir, tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top

  config = _config(corpus_dir, cache=str(tmp_path / "cache"))
  tokens = load_corpus(config)["train"].tokens
  again = pickle.loads(pickle.dumps(tokens))
  np.testing.assert_array_equal(again[5:50], tokens[5:50])


def _cli(*args) -> int:
  return cli.main(["data", "prepare", "--preset", "none", "--quiet", *args])


def test_cli_prepare_writes_a_cache_then_has_nothing_to_do(corpus_dir, tmp_path, capsys):
  pattern = f"data.paths=[{corpus_dir}/*.txt]"
  assert _cli("data.source=text", pattern, "--cache", str(tmp_path / "cache")) == 0
  assert "23 documents" in capsys.readouterr().out
  before = _tree(tmp_path / "cache")
  assert _cli("data.source=text", pattern, "--cache", str(tmp_path / "cache")) == 0
  assert _tree(tmp_path / "cache") == before


def test_progress_off_a_terminal_is_lines_counting_the_documents_there_are(corpus_dir, tmp_path,
                                                                          capsys):
  """23 files and max_documents 400 (lm-small's): the count ends at 23/23, in plain lines."""
  assert cli.main(["data", "prepare", "lm-small", "data.source=text",
                   f"data.paths=[{corpus_dir}/*.txt]", "--cache", str(tmp_path / "cache")]) == 0
  err = capsys.readouterr().err
  assert "\r" not in err and "doc 23/23: " in err and "/400" not in err


def test_cli_workers_flag(corpus_dir, tmp_path, capsys):
  pattern = f"data.paths=[{corpus_dir}/*.txt]"
  token_cache.prepare(_config(corpus_dir), tmp_path / "one", progress=False)
  assert _cli("data.source=text", pattern, "--cache", str(tmp_path / "two"), "--workers", "2") == 0
  assert "23 documents" in capsys.readouterr().out
  assert _tree(tmp_path / "two") == _tree(tmp_path / "one")
  with pytest.raises(SystemExit):
    _cli("data.source=text", pattern, "--cache", str(tmp_path / "x"), "--workers", "0")
  assert "must be an integer >= 1, got '0'" in capsys.readouterr().err


def _one_line_error(capsys) -> str:
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  return err


def test_cli_bad_input_exits_2_with_one_line(corpus_dir, tmp_path, capsys):
  cache = str(tmp_path / "cache")
  assert _cli("data.source=text", f"data.paths=[{tmp_path}/nothing.txt]", "--cache", cache) == 2
  assert "no such file" in _one_line_error(capsys)
  (tmp_path / "empty.txt").write_text("")
  assert _cli("data.source=text", f"data.paths=[{tmp_path}/empty.txt]", "--cache", cache) == 2
  assert "the corpus is empty" in _one_line_error(capsys)
  assert not (tmp_path / "cache" / "manifest.json").exists()
  (tmp_path / "a_file").write_text("x")
  pattern = f"data.paths=[{corpus_dir}/*.txt]"
  assert _cli("data.source=text", pattern, "--cache", str(tmp_path / "a_file")) == 2
  assert "is a file" in _one_line_error(capsys)
  (tmp_path / "bad.json").write_text("not a tokenizer")
  assert _cli("data.source=text", pattern, "data.tokenizer=huggingface",
              f"data.tokenizer_path={tmp_path}/bad.json", "--cache", cache) == 2
  assert "bad.json" in _one_line_error(capsys)
  assert not (tmp_path / "cache" / "manifest.json").exists()
  assert _cli("data.source=text", pattern, "--cache", cache) == 0
  capsys.readouterr()
  manifest = tmp_path / "cache" / "manifest.json"
  manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 7}))
  assert _cli("data.source=text", pattern, "--cache", cache) == 2
  assert "format version 7 is newer" in _one_line_error(capsys)
  assert cli.main(["data", "prepare", "--preset", "none", "--quiet"]) == 2
  assert "--cache" in _one_line_error(capsys)


def test_unwritable_cache_directory(corpus_dir, tmp_path, capsys):
  import os  # pylint: disable=g-import-not-at-top

  if os.geteuid() == 0:
    pytest.skip("root writes anywhere")
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  try:
    assert _cli("data.source=text", f"data.paths=[{corpus_dir}/*.txt]", "--cache",
                str(locked / "cache")) == 2
    assert "cannot create" in _one_line_error(capsys)
  finally:
    locked.chmod(0o700)


def test_data_cache_is_refused_for_an_image_set():
  from jax_ai_stack.recipes import configlib  # pylint: disable=g-import-not-at-top

  with pytest.raises(configlib.ConfigError, match=r"data\.cache: source='digits'"):
    configlib.from_dict(DataConfig, {"source": "digits", "cache": "somewhere"})



def test_worker_processes_read_the_cache(corpus_dir, tmp_path):
  memory = _config(corpus_dir)
  cached = dataclasses.replace(memory, cache=str(tmp_path / "cache"), num_workers=1)
  _assert_same(_batches(memory, "train", 3), _batches(cached, "train", 3))
