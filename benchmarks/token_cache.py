"""Token cache benchmark: prepare and read speed, and memory of training from a big cache.

Measures, in one run, each against a baseline from the same run:

1. prepare: tokens/s of `token_cache.prepare` with 1 and 2 worker processes
   on a generated text corpus (random words), against the tokenizer's own
   `encode_batch` speed on the same texts held in memory. Tokenizers: byte,
   and a Hugging Face BPE and a SentencePiece model trained here on a sample
   of the corpus (no download) when their packages are installed; those two
   run on a corpus 8x smaller, being slower.
2. read: tokens/s of random training windows (batch x (seq_len + 1)) taken
   through `CachedTokens`, and of `TokenCache.read` in large sequential
   slices, against reading the cache's chunk files with plain Python I/O
   (the same bytes, still compressed; both from the page cache).
3. memory: peak RSS (VmHWM) of a subprocess that builds the train dataset
   from a cache and iterates batches, on a cache of 2 GiB of tokens against
   one of ~20 MB. Target: within 100 MB. The big cache is prepared by the
   real `prepare` from generated `.npy` token files (`data.source=npy`, so
   no tokenizing: random byte ids with an EOS every ~1M tokens), which is
   the fast way to get a real cache of that size.

    python benchmarks/token_cache.py            # ~64 MB corpus, 2 GiB cache; minutes
    python benchmarks/token_cache.py --quick    # smoke test; the big cache is 64 MiB

Writes a JSON record (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import common
from jax_ai_stack.recipes.data import DataConfig, build_tokenizer, token_cache

TARGET_RSS_MB = 100
"""Training from a 2 GiB cache may take at most 100 MB more memory than from a 20 MB one."""
DOCUMENT_BYTES = 16 << 10
SHARD_DOCUMENTS = 128
_WORDS = 2000

_CHILD = """
import json, resource, sys
from jax_ai_stack.recipes.data import DataConfig, build_dataset

config = DataConfig(**json.loads(sys.argv[1]))
iterator = iter(build_dataset(config, split="train", seed=0, process_index=0, process_count=1))
for _ in range(int(sys.argv[2])):
  next(iterator)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"vm_hwm_kb": int(status["VmHWM"].split()[0]),
                  "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def write_text_corpus(directory: pathlib.Path, megabytes: float, seed: int = 0) -> list[str]:
  """Files of ~16 KB of random words (so BPE has merges to find); returns the texts."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
  words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(_WORDS)]
  directory.mkdir(parents=True)
  texts = []
  for i in range(max(int(megabytes * 2**20) // DOCUMENT_BYTES, 2)):
    picks = rng.integers(0, _WORDS, DOCUMENT_BYTES // 6)
    text = " ".join(words[j] for j in picks)
    (directory / f"doc{i:06d}.txt").write_text(text)
    texts.append(text)
  return texts


def train_tokenizers(directory: pathlib.Path, sample: list[str]) -> dict[str, str]:
  """Tokenizer files trained here on `sample`, per installed package (no download)."""
  files = {}
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
    from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    files["huggingface"] = str(directory / "tokenizer.json")
    tok.save(files["huggingface"])
  except ImportError:
    pass
  try:
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    model = io.BytesIO()
    lines = [text[i:i + 2000] for text in sample for i in range(0, len(text), 2000)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=4000, hard_vocab_limit=False, model_type="bpe",
                                   minloglevel=2)
    files["sentencepiece"] = str(directory / "sp.model")
    pathlib.Path(files["sentencepiece"]).write_bytes(model.getvalue())
  except ImportError:
    pass
  return files


def raw_tokens_per_s(config: DataConfig, texts: list[str]) -> float:
  """The tokenizer's own speed: `encode_batch` over the texts, already in memory."""
  tokenizer = build_tokenizer(config)
  start = time.perf_counter()
  count = sum(len(ids) for i in range(0, len(texts), 256)
              for ids in tokenizer.encode_batch(texts[i:i + 256]))
  return count / (time.perf_counter() - start)


def prepare_tokens_per_s(config: DataConfig, where: pathlib.Path, workers: int) -> float:
  start = time.perf_counter()
  manifest = token_cache.prepare(config, where, shard_documents=SHARD_DOCUMENTS,
                                 progress=False, workers=workers)
  return manifest.num_tokens / (time.perf_counter() - start)


def bench_prepare(workdir: pathlib.Path, corpus_mb: float) -> list[dict[str, Any]]:
  texts = write_text_corpus(workdir / "text", corpus_mb)
  small = texts[:max(len(texts) // 8, 2)]
  kinds = {"byte": None, **train_tokenizers(workdir, small[:64])}
  rows = []
  for kind, path in kinds.items():
    used = texts if kind == "byte" else small
    pattern = str(workdir / "text" / "*.txt")
    config = DataConfig(source="text", paths=(pattern,), tokenizer=kind, tokenizer_path=path,
                        max_documents=len(used))
    raw = raw_tokens_per_s(config, used)
    for workers in (1, 2):
      where = workdir / f"cache_{kind}_{workers}"
      rate = prepare_tokens_per_s(config, where, workers)
      rows.append({"tokenizer": kind, "workers": workers, "documents": len(used),
                   "text_mb": sum(map(len, used)) / 2**20, "tokens_per_s": rate,
                   "tokens_per_s_per_worker": rate / workers, "raw_tokens_per_s": raw,
                   "vs_raw": rate / raw})
      if (kind, workers) != ("byte", 1):
        shutil.rmtree(where)
  return rows


def bench_read(where: pathlib.Path, batches: int, batch_size: int = 16,
               seq_len: int = 1024) -> dict[str, Any]:
  """Random windows through `CachedTokens` and sequential slices, against raw file reads."""
  config = DataConfig(source="text", paths=(str(where.parent / "text" / "*.txt"),))
  cache = token_cache.TokenCache.open(where)
  tokens = token_cache.split_corpora(cache, config)["train"].tokens
  rng = np.random.default_rng(0)
  offsets = np.arange(seq_len + 1)
  tokens[rng.integers(0, len(tokens) - seq_len - 1, batch_size)[:, None] + offsets]  # warm up
  start = time.perf_counter()
  for _ in range(batches):
    tokens[rng.integers(0, len(tokens) - seq_len - 1, batch_size)[:, None] + offsets]
  windows_s = time.perf_counter() - start
  step = 1 << 22
  start = time.perf_counter()
  for i in range(0, cache.num_tokens, step):
    cache.read(i, min(i + step, cache.num_tokens))
  sequential_s = time.perf_counter() - start
  files = sorted((where / "tokens" / "c").iterdir())
  start = time.perf_counter()
  nbytes = 0
  for path in files:
    with open(path, "rb") as f:
      nbytes += len(f.read())
  raw_s = time.perf_counter() - start
  window_tokens = batches * batch_size * (seq_len + 1)
  raw = cache.num_tokens / raw_s
  return {"num_tokens": cache.num_tokens, "chunk_tokens": cache.manifest.layout["chunk_tokens"],
          "batch_size": batch_size, "seq_len": seq_len, "batches": batches,
          "windows_tokens_per_s": window_tokens / windows_s,
          "sequential_tokens_per_s": cache.num_tokens / sequential_s,
          "raw_file_tokens_per_s": raw, "raw_file_mb_per_s": nbytes / 2**20 / raw_s,
          "chunk_bytes_on_disk": nbytes,
          "windows_vs_raw": window_tokens / windows_s / raw,
          "sequential_vs_raw": cache.num_tokens / sequential_s / raw}


def write_npy_corpus(directory: pathlib.Path, num_tokens: int, seed: int = 0) -> None:
  """Random byte ids (0..255) with an EOS (257) every ~1M tokens, in .npy files of <= 64M."""
  directory.mkdir(parents=True)
  per_file = min(num_tokens, 1 << 26)
  rng = np.random.default_rng(seed)
  block = rng.integers(0, 256, per_file, dtype=np.uint16)
  block[(1 << 20) - 1::1 << 20] = 257
  for i, start in enumerate(range(0, num_tokens, per_file)):
    np.save(directory / f"tokens{i:03d}.npy", np.roll(block, 4099 * i)[:num_tokens - start])


def child_rss(workdir: pathlib.Path, name: str, num_tokens: int, batches: int) -> dict:
  """Prepares a cache of `num_tokens` from .npy files; peak RSS of a child training from it."""
  write_npy_corpus(workdir / name, num_tokens)
  config = {"source": "npy", "paths": [str(workdir / name / "*.npy")], "seq_len": 1024,
            "batch_size": 8, "cache": str(workdir / f"cache_{name}")}
  start = time.perf_counter()
  token_cache.prepare(DataConfig(**{**config, "paths": tuple(config["paths"])}),
                      config["cache"], shard_documents=16, progress=False)
  prepare_s = time.perf_counter() - start
  start = time.perf_counter()
  child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(config), str(batches)],
                         capture_output=True, text=True, check=False)
  if child.returncode:
    raise RuntimeError(f"the training subprocess failed:\n{child.stderr[-3000:]}")
  measured = json.loads(child.stdout.strip().splitlines()[-1])
  return {"num_tokens": num_tokens, "prepare_s": prepare_s,
          "child_s": time.perf_counter() - start, "batches": batches,
          "peak_rss_mb": measured["vm_hwm_kb"] / 1024,
          "ru_maxrss_mb": measured["ru_maxrss_kb"] / 1024}


def bench_memory(workdir: pathlib.Path, big_tokens: int, batches: int) -> dict[str, Any]:
  small = child_rss(workdir, "small", 10 << 20, batches)
  big = child_rss(workdir, "big", big_tokens, batches)
  delta = big["peak_rss_mb"] - small["peak_rss_mb"]
  return {"small": small, "big": big, "rss_delta_mb": delta, "target_mb": TARGET_RSS_MB,
          "met_target": delta <= TARGET_RSS_MB}


def print_table(results: dict[str, Any]) -> None:
  print(f"\ntoken cache; {results['machine']}{' (--quick: sizes mean nothing)' if results['quick'] else ''}")
  print(f"{'prepare':<26}{'workers':>8}{'tokens/s':>13}{'per worker':>13}{'raw tok/s':>15}"
        f"{'vs raw':>8}")
  for row in results["prepare"]:
    name = f"{row['tokenizer']} ({row['text_mb']:.0f} MB text)"
    print(f"{name:<26}{row['workers']:>8}{row['tokens_per_s']:>13,.0f}"
          f"{row['tokens_per_s_per_worker']:>13,.0f}{row['raw_tokens_per_s']:>15,.0f}"
          f"{row['vs_raw']:>8.2f}")
  if not any(row["tokenizer"] != "byte" for row in results["prepare"]):
    print("(huggingface / sentencepiece not installed: byte tokenizer only)")
  read = results["read"]
  print(f"\n{'read (' + format(read['num_tokens'], ',') + ' tokens)':<46}{'tokens/s':>14}"
        f"{'vs raw':>8}")
  print(f"{'raw chunk files, sequential (plain I/O)':<46}{read['raw_file_tokens_per_s']:>14,.0f}"
        f"{1:>8.2f}")
  print(f"{'TokenCache.read, sequential 4M slices':<46}{read['sequential_tokens_per_s']:>14,.0f}"
        f"{read['sequential_vs_raw']:>8.2f}")
  name = f"CachedTokens, random {read['batch_size']}x{read['seq_len'] + 1} windows"
  print(f"{name:<46}{read['windows_tokens_per_s']:>14,.0f}{read['windows_vs_raw']:>8.4f}")
  memory = results["memory"]
  print(f"\n{'training subprocess':<36}{'tokens':>15}{'peak RSS MB':>13}{'prepare s':>11}")
  for key in ("small", "big"):
    row = memory[key]
    print(f"{key + ' cache, ' + str(row['batches']) + ' batches':<36}{row['num_tokens']:>15,}"
          f"{row['peak_rss_mb']:>13.0f}{row['prepare_s']:>11.1f}")
  if results["quick"]:
    print("(--quick: the big cache is 64 MiB of tokens, not 2 GiB)")
  verdict = "met" if memory["met_target"] else "MISSED"
  print(f"big - small peak RSS = {memory['rss_delta_mb']:.0f} MB (target <= {TARGET_RSS_MB}:"
        f" {verdict})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/token_cache.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--corpus-mb", type=float, default=64,
                      help="text corpus for the prepare and read figures (default: 64)")
  parser.add_argument("--big-gib", type=float, default=2,
                      help="GiB of uint16 tokens in the big cache (default: 2)")
  parser.add_argument("--batches", type=int, default=200,
                      help="batches read and trained on (default: 200)")
  parser.add_argument("--dir", type=pathlib.Path, default=None,
                      help="write under a new temporary directory here (default: the system's)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: 2 MB corpus, 64 MiB big cache, 20 batches")
  common.add_out_argument(parser, "token_cache")
  args = parser.parse_args(argv)
  if args.quick:
    args.corpus_mb, args.big_gib, args.batches = 2, 1 / 16, 20
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="jax_ai_stack_token_cache_", dir=args.dir))
  try:
    prepare = bench_prepare(workdir, args.corpus_mb)
    read = bench_read(workdir / "cache_byte_1", args.batches)
    memory = bench_memory(workdir, int(args.big_gib * 2**29), args.batches)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  results = {**common.header("token_cache", device=False), "machine": platform.platform(),
             "quick": args.quick,
             "prepare": prepare, "read": read, "memory": memory}
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":  # spawned prepare workers re-import this module
  main(sys.argv[1:])
