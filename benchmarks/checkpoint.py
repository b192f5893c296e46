"""How long a checkpoint save blocks training, and how fast it writes.

`jax_ai_stack.recipes.checkpoint.save` writes the model/optimizer state, the
Grain iterator position and JSON metadata as one Orbax step. With
`CheckpointConfig(async_save=True)` the caller should only wait while arrays
are copied off the device; the write to disk happens in a background thread.
In one process, on a state of about 1 GB (`--size-mb`), this measures

  sync save      save() with async_save=False: the caller waits for the write
  async blocking how long save() holds the caller with async_save=True
  async total    until `manager.wait_until_finished()` returns
  raw write      the same number of bytes written with os.write + fsync to a
                 file in the same directory: the disk's speed, the baseline

and reports async blocking / sync save (target < 0.10) and the save throughput
(bytes / sync save time) against the raw write speed.

Each measurement starts from flushed page caches (`os.sync`, untimed) and a
fresh directory, and the three kinds alternate round by round, so that one does
not pay for another's dirty pages; each figure is the median over rounds. All
files go in a new temporary directory (under `--dir` if given) that is removed
at the end.

    python benchmarks/checkpoint.py                 # ~1 GB, 3 rounds
    python benchmarks/checkpoint.py --size-mb 256 --dir /mnt/fast
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes import checkpoint

TARGET_RATIO = 0.10
"""An async save may block the caller for under 10% of a synchronous save."""
NUM_ARRAYS = 4
WRITE_CHUNK_BYTES = 64 << 20


class BigState(nnx.Module):
  """A few large float32 parameters: a state of a chosen size, no model code.

  Random values, so that a compressing writer gains nothing over the raw write.
  """

  def __init__(self, total_bytes: int, num_arrays: int = NUM_ARRAYS, seed: int = 0):
    rng = np.random.default_rng(seed)
    per_array = max(total_bytes // 4 // num_arrays, 1)
    for i in range(num_arrays):
      setattr(self, f"w{i}", nnx.Param(jnp.asarray(rng.random(per_array, dtype=np.float32))))


def make_state(size_mb: float) -> nnx.State:
  return nnx.split(BigState(int(size_mb * 2**20)))[1]


def state_bytes(state: nnx.State) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(state))


def drop_caches_of_writes() -> None:
  """Flushes dirty pages of earlier runs, so they do not slow the next one."""
  if hasattr(os, "sync"):
    os.sync()


def raw_write_seconds(directory: pathlib.Path, buffers: Sequence[memoryview]) -> float:
  """Seconds to write `buffers` to a new file in `directory` and fsync it."""
  path = directory / "raw_write.bin"
  sync = getattr(os, "fdatasync", os.fsync)
  start = time.perf_counter()
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    for buffer in buffers:
      for offset in range(0, len(buffer), WRITE_CHUNK_BYTES):
        chunk = buffer[offset:offset + WRITE_CHUNK_BYTES]
        while chunk:
          chunk = chunk[os.write(fd, chunk):]
    sync(fd)
  finally:
    os.close(fd)
  seconds = time.perf_counter() - start
  path.unlink()
  return seconds


def directory_bytes(directory: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def timed_save(directory: pathlib.Path, state: nnx.State, *, async_save: bool) -> dict[str, float]:
  """One `checkpoint.save` into a fresh manager: seconds blocked and in total."""
  manager = checkpoint.build_manager(
      directory, checkpoint.CheckpointConfig(async_save=async_save, save_every=1, keep_last=1)
  )
  data_iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
  try:
    start = time.perf_counter()
    saved = checkpoint.save(
        manager, 0, state, data_iterator, {"benchmark": "checkpoint"}, force=True
    )
    blocked = time.perf_counter() - start
    manager.wait_until_finished()
    total = time.perf_counter() - start
  finally:
    manager.close()
  if not saved or manager.latest_step() != 0:
    raise RuntimeError(f"checkpoint.save did not write step 0 in {directory}")
  return {"blocking_s": blocked, "total_s": total, "bytes_on_disk": directory_bytes(directory)}


def bench(state: nnx.State, workdir: pathlib.Path, rounds: int) -> dict[str, Any]:
  """Alternates sync save, async save and raw write for `rounds` rounds."""
  buffers = [memoryview(np.asarray(x)).cast("B") for x in jax.tree.leaves(state)]
  warmup = make_state(0.25)  # Starts Orbax's threads and TensorStore, untimed.
  for async_save in (False, True):
    timed_save(workdir / f"warmup_{async_save}", warmup, async_save=async_save)
  runs = {"sync": [], "async": [], "raw_write_s": []}
  for index in range(rounds):
    for kind in ("sync", "async"):
      directory = workdir / f"{kind}_{index}"
      drop_caches_of_writes()
      runs[kind].append(timed_save(directory, state, async_save=kind == "async"))
      shutil.rmtree(directory)
    drop_caches_of_writes()
    runs["raw_write_s"].append(raw_write_seconds(workdir, buffers))
  return runs


def summarize(runs: dict[str, Any], nbytes: int) -> dict[str, Any]:
  median = lambda kind, key: statistics.median(r[key] for r in runs[kind])
  sync_s = median("sync", "total_s")
  async_blocking_s = median("async", "blocking_s")
  raw_s = statistics.median(runs["raw_write_s"])
  ratio = async_blocking_s / sync_s
  mb = nbytes / 2**20
  return {
      "sync_save_s": sync_s,
      "async_blocking_s": async_blocking_s,
      "async_total_s": median("async", "total_s"),
      "raw_write_s": raw_s,
      "sync_save_mb_per_s": mb / sync_s,
      "raw_write_mb_per_s": mb / raw_s,
      "save_vs_raw_throughput": raw_s / sync_s,
      "async_blocking_ratio": ratio,
      "target_ratio": TARGET_RATIO,
      "met_target": ratio < TARGET_RATIO,
      "bytes_on_disk": runs["sync"][0]["bytes_on_disk"],
      "runs": runs,
  }


def print_table(results: dict[str, Any]) -> None:
  mb = results["state_bytes"] / 2**20
  print(f"\ncheckpoint of {mb:.0f} MiB ({results['num_arrays']} float32 arrays) in "
        f"{results['directory']}; {results['device']}; orbax {results['orbax']}; "
        f"median of {results['rounds']} rounds")
  header = f"{'what':22} {'seconds':>9} {'MiB/s':>9}"
  print(header)
  print("-" * len(header))
  rows = [
      ("sync save", results["sync_save_s"], mb / results["sync_save_s"]),
      ("async save: blocking", results["async_blocking_s"], None),
      ("async save: total", results["async_total_s"], mb / results["async_total_s"]),
      ("raw write + fsync", results["raw_write_s"], mb / results["raw_write_s"]),
  ]
  for name, seconds, speed in rows:
    print(f"{name:22} {seconds:9.3f} {'' if speed is None else f'{speed:9.0f}':>9}")
  verdict = "met" if results["met_target"] else "MISSED"
  print(f"async blocking / sync save = {results['async_blocking_ratio']:.3f} "
        f"(target < {TARGET_RATIO}: {verdict}); save throughput / raw write = "
        f"{results['save_vs_raw_throughput']:.2f}; on disk {results['bytes_on_disk'] / 2**20:.0f} MiB")


def _positive(kind):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = 0
    if not value > 0:
      raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value
  return parse


def _existing_dir(text: str) -> pathlib.Path:
  path = pathlib.Path(text)
  if not path.is_dir():
    raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
  return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="benchmarks/checkpoint.py", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--size-mb", type=_positive(float), default=1024.0,
                      help="state size in MiB (default: 1024)")
  parser.add_argument("--rounds", type=_positive(int), default=3,
                      help="rounds of sync save, async save and raw write; medians "
                           "are reported (default: 3)")
  parser.add_argument("--dir", type=_existing_dir, default=None,
                      help="write under a new temporary directory here (default: the "
                           "system temporary directory); put it on the disk you train on")
  parser.add_argument("--quick", action="store_true", help="smoke test: 4 MiB, one round")
  common.add_out_argument(parser, "checkpoint")
  args = parser.parse_args(argv)
  if args.quick:
    args.size_mb, args.rounds = 4.0, 1
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="jax_ai_stack_ckpt_bench_", dir=args.dir))
  try:
    needed = 3 * args.size_mb * 2**20  # A checkpoint, a raw file, and slack.
    free = shutil.disk_usage(workdir).free
    if free < needed:
      raise SystemExit(
          f"benchmarks/checkpoint.py: {workdir.parent} has {free / 2**20:.0f} MiB free; "
          f"--size-mb {args.size_mb:g} needs about {needed / 2**20:.0f} MiB"
      )
    state = make_state(args.size_mb)
    runs = bench(state, workdir, args.rounds)
    nbytes = state_bytes(state)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  results = {
      **common.header("checkpoint"),
      "orbax": importlib_metadata.version("orbax-checkpoint"),
      "directory": str(workdir.parent),
      "state_bytes": nbytes,
      "num_arrays": NUM_ARRAYS,
      "rounds": args.rounds,
      "quick": args.quick,
      **summarize(runs, nbytes),
  }
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
