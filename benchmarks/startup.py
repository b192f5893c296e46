"""How long a rerun (or a resume) waits for its first step, with a warm XLA cache.

`jax-ai-stack train` keeps compiled programs in a persistent compilation cache
(`train.compile_cache`, `recipes/compile_cache.py`). This runs the same recipe
as a user does, each time in a new process and a new workdir:

  cold  an empty cache directory (a fresh temporary one): everything compiles
  warm  the same command again: the programs come from the cache

and reads each run's `--verbose` start-up line: time to the first step (import
+ init + first step, the wait a user sees) and how many programs came from the
cache. It reports warm / cold time to first step (target <= 0.5) as the median
over `--rounds` (a new cache directory each round).

    python benchmarks/startup.py            # lm-tiny, 2 rounds (about 2 min on 2 cores)
    python benchmarks/startup.py --quick    # a one-layer model: a smoke test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import common

TARGET_RATIO = 0.5
"""A warm run may wait at most half as long for its first step as a cold one."""

RUN = ["lm-tiny", "train.steps=1", "train.eval_every=0", "train.sample_tokens=0",
       "train.progress=false"]
QUICK = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=16", "data.batch_size=4",
         "data.max_documents=30"]
_LINE = re.compile(r"start-up: import ([\d.]+) s, init ([\d.]+) s .*first step after ([\d.]+) s; "
                   r"of which trace ([\d.]+) s, compile ([\d.]+) s \((\d+) programs, "
                   r"(?:(\d+) loaded from the cache|no persistent cache)")


def parse_startup(output: str) -> dict[str, float]:
  """The figures of `train --verbose`'s start-up line; ValueError if there is none."""
  match = _LINE.search(output)
  if match is None:
    raise ValueError(f"no start-up line in the output of train --verbose:\n{output[-2000:]}")
  import_s, init_s, first_s, trace_s, compile_s = (float(match.group(i)) for i in range(1, 6))
  return {
      "first_step_s": import_s + first_s, "import_s": import_s, "init_s": init_s,
      "trace_s": trace_s, "compile_s": compile_s, "programs": int(match.group(6)),
      "cache_hits": int(match.group(7) or 0),
  }


def train_once(workdir: pathlib.Path, cache: pathlib.Path, overrides: Sequence[str]) -> dict:
  """One `jax-ai-stack train --verbose` in a new process; its start-up figures."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"))
  command = [sys.executable, "-m", "jax_ai_stack.cli", "train", *RUN, *overrides,
             "--workdir", str(workdir), "--resume", "never", "--verbose"]
  started = time.perf_counter()
  result = subprocess.run(command, capture_output=True, text=True, env=env, errors="replace")
  wall = time.perf_counter() - started
  if result.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
  return {**parse_startup(result.stdout), "process_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
  overrides = QUICK if args.quick else []
  rounds = []
  with tempfile.TemporaryDirectory(prefix="jax-ai-stack-startup-") as tmp:
    for index in range(args.rounds):
      cache = pathlib.Path(tmp) / f"cache-{index}"  # Empty: a cold start.
      cold = train_once(pathlib.Path(tmp) / f"cold-{index}", cache, overrides)
      warm = train_once(pathlib.Path(tmp) / f"warm-{index}", cache, overrides)
      entries = sum(1 for p in cache.iterdir() if p.name.endswith("-cache"))
      rounds.append({"cold": cold, "warm": warm, "cache_entries": entries,
                     "cache_bytes": sum(p.stat().st_size for p in cache.iterdir()),
                     "ratio": warm["first_step_s"] / cold["first_step_s"]})
      print(f"round {index + 1}: cold {cold['first_step_s']:.1f} s, warm "
            f"{warm['first_step_s']:.1f} s to the first step ({warm['cache_hits']} of "
            f"{warm['programs']} programs from the cache)", flush=True)
  ratio = statistics.median(r["ratio"] for r in rounds)
  return {
      **common.header("startup", device=False),  # JAX runs in the timed subprocesses only.
      "command": ["jax-ai-stack", "train", *RUN, *overrides],
      "quick": args.quick,
      "rounds": rounds,
      "cold_first_step_s": statistics.median(r["cold"]["first_step_s"] for r in rounds),
      "warm_first_step_s": statistics.median(r["warm"]["first_step_s"] for r in rounds),
      "ratio_warm_vs_cold": ratio,
      "target_ratio": TARGET_RATIO,
      "met_target": ratio <= TARGET_RATIO,
  }


def print_table(results: dict[str, Any]) -> None:
  print(f"\n{'':6} {'first step':>10} {'import':>7} {'init':>6} {'trace':>6} {'compile':>8} "
        f"{'cached':>7}")
  for kind in ("cold", "warm"):
    figures = results["rounds"][-1][kind]
    print(f"{kind:6} {figures['first_step_s']:9.1f}s {figures['import_s']:6.1f}s "
          f"{figures['init_s']:5.1f}s {figures['trace_s']:5.1f}s {figures['compile_s']:7.1f}s "
          f"{figures['cache_hits']:>3}/{figures['programs']}")
  verdict = common.verdict(results["ratio_warm_vs_cold"], TARGET_RATIO)
  print(f"warm / cold time to first step = {results['ratio_warm_vs_cold']:.2f} (median of "
        f"{len(results['rounds'])}; target <= {TARGET_RATIO}: {verdict})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/startup.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=common.positive_int, default=None,
                      help="cold + warm pairs, each with a new cache (default: 2; 1 with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a one-layer model, one round")
  common.add_out_argument(parser, "startup")
  args = parser.parse_args(argv)
  args.rounds = args.rounds or (1 if args.quick else 2)
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  results = run(args)
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
