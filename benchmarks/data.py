"""Data pipeline benchmark: Grain LM pipeline vs a plain NumPy loop, and data wait.

Measures, in one run on the same corpus (the stdlib corpus, lm-tiny sized):

1. batches/s of `build_dataset` (train, fixed windows and packing) with 0 and
   2 workers, against a plain NumPy loop that slices the same random windows
   out of the same token array (the cost floor; packing does more work per
   batch than this windows-only loop);
2. the fraction of a tiny-model train step spent waiting in `next(iterator)`,
   without workers (with and without the prefetch thread) and with 2 workers.
   Target: under 2% with the default config (0 workers, prefetch thread).

Workers pay off only when building a batch is heavy; here a batch is a few
NumPy gathers, so shipping it between processes costs more than building it.

Usage:
  python benchmarks/data.py [--batches 1000] [--steps 200] [--width 32] [--out data.json]

Prints a table and writes a JSON record (to results/data.json unless --out).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence

import numpy as np

import common
from jax_ai_stack.recipes import data

_CORPUS = dict(max_documents=400, seq_len=128)


def _python_speed_us() -> float:
  """Best-of-5 microseconds of `sum(range(1000))`: how fast (or busy) this host
  runs Python, to compare timings across machines (~10 us on an idle modern CPU)."""
  import timeit  # pylint: disable=g-import-not-at-top

  return min(timeit.repeat("sum(range(1000))", number=1000, repeat=5)) * 1e3


def _numpy_baseline(tokens: np.ndarray, seq_len: int, batch_size: int, batches: int) -> float:
  """batches/s of the same work done by hand: random windows, one gather each."""
  rng = np.random.default_rng(0)
  count = (len(tokens) - 1) // seq_len
  offsets = np.arange(seq_len + 1)
  start = time.perf_counter()
  for _ in range(batches):
    ids = rng.integers(0, count, batch_size)
    windows = tokens[ids[:, None] * seq_len + offsets].astype(np.int32)
    batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
  del batch
  return batches / (time.perf_counter() - start)


def _pipeline_rate(config: data.DataConfig, batches: int) -> float:
  iterator = iter(data.build_dataset(config, split="train", seed=0, process_index=0,
                                     process_count=1))
  for _ in range(20):  # start workers, fill buffers
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  rate = batches / (time.perf_counter() - start)
  iterator.close()
  return rate


def _tiny_model_step(vocab: int, seq_len: int, width: int):
  """A jitted train step of a tiny next-token model (embed -> MLP -> logits)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  keys = jax.random.split(jax.random.key(0), 4)
  params = {
      "embed": jax.random.normal(keys[0], (vocab, width)) * 0.02,
      "position": jax.random.normal(keys[1], (seq_len, width)) * 0.02,
      "hidden": jax.random.normal(keys[2], (width, 4 * width)) * width**-0.5,
      "out": jax.random.normal(keys[3], (4 * width, vocab)) * (4 * width)**-0.5,
  }
  optimizer = optax.adamw(1e-3)

  def loss_fn(params, batch):
    x = params["embed"][batch["inputs"]] + params["position"][batch["positions"]]
    logits = jax.nn.gelu(x @ params["hidden"]) @ params["out"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, params, optimizer.init(params)


def _train(step, state, batches, steps: int) -> tuple[float, float, float]:
  """Seconds of `steps` train steps: wall, wall inside next(batches), and this
  thread's CPU time inside next(batches).

  Each step blocks on its loss, as a trainer that logs the loss every step
  does, so the time in `next` is time the step really waits for data. CPU
  time tells the pipeline's own cost apart from waiting for a busy machine.
  """
  params, opt_state = state
  waited = cpu = 0.0
  start = time.perf_counter()
  for _ in range(steps):
    before, before_cpu = time.perf_counter(), time.thread_time()
    batch = next(batches)
    waited += time.perf_counter() - before
    cpu += time.thread_time() - before_cpu
    params, opt_state, loss = step(params, opt_state, batch)
    loss.block_until_ready()
  return time.perf_counter() - start, waited, cpu


def _data_wait(config: data.DataConfig, steps: int, width: int, repeats: int = 3) -> dict:
  """Share of train-step time spent in `next(iterator)`, median of `repeats` runs."""
  step, params, opt_state = _tiny_model_step(data.vocab_size(config), config.seq_len, width)
  state = (params, opt_state)
  iterator = iter(data.build_dataset(config, split="train", seed=0, process_index=0,
                                     process_count=1))
  _train(step, state, iterator, 10)  # compile, start workers
  runs = sorted((_train(step, state, iterator, steps) for _ in range(repeats)),
                key=lambda run: run[1] / run[0])
  iterator.close()
  total, waited, cpu = runs[len(runs) // 2]
  return {"step_ms": 1e3 * total / steps, "wait_ms": 1e3 * waited / steps,
          "wait_cpu_ms": 1e3 * cpu / steps, "wait_fraction": waited / total}


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=1000)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--width", type=int, default=32, help="tiny model width")
  parser.add_argument("--quick", action="store_true",
                      help="20 batches, 10 steps: a smoke test (the timings mean nothing)")
  common.add_out_argument(parser, "data")
  args = parser.parse_args(argv)
  if args.quick:
    args.batches, args.steps = 20, 10

  base = data.DataConfig(**_CORPUS, batch_size=args.batch_size)
  tokens = data.load_corpus(base)["train"].tokens
  results = {
      **common.header("data"),
      "corpus_tokens": int(len(tokens)),
      "batch_size": args.batch_size,
      "seq_len": base.seq_len,
      "model_width": args.width,
      "numpy_batches_per_s": _numpy_baseline(tokens, base.seq_len, args.batch_size, args.batches),
      "pipeline": [],
      "data_wait": [],
      "machine": platform.platform(),
      "python_speed_us": _python_speed_us(),
  }
  for packing in (False, True):
    for workers in (0, 2):
      config = data.DataConfig(**_CORPUS, batch_size=args.batch_size, packing=packing,
                               num_workers=workers)
      rate = _pipeline_rate(config, args.batches)
      results["pipeline"].append({
          "packing": packing, "num_workers": workers, "batches_per_s": rate,
          "vs_numpy": rate / results["numpy_batches_per_s"],
      })
  for workers, prefetch in ((0, 0), (0, 4), (2, 4)):
    config = data.DataConfig(**_CORPUS, batch_size=args.batch_size, num_workers=workers,
                             prefetch_batches=prefetch)
    results["data_wait"].append({"num_workers": workers, "prefetch_batches": prefetch,
                                 **_data_wait(config, args.steps, args.width)})

  print(f"corpus: {results['corpus_tokens']} tokens, batch {args.batch_size} x {base.seq_len};"
        f" sum(range(1000)) takes {results['python_speed_us']:.1f} us here")
  print(f"{'pipeline':<28}{'batches/s':>12}{'vs numpy':>10}")
  print(f"{'plain numpy loop':<28}{results['numpy_batches_per_s']:>12.0f}{1:>10.2f}")
  for row in results["pipeline"]:
    name = f"grain {'packing' if row['packing'] else 'windows'}, {row['num_workers']} workers"
    print(f"{name:<28}{row['batches_per_s']:>12.0f}{row['vs_numpy']:>10.2f}")
  print(f"{'tiny-model step':<28}{'step ms':>12}{'wait ms':>10}{'of it CPU':>11}"
        f"{'wait %':>9}")
  for row in results["data_wait"]:
    name = f"{row['num_workers']} workers, prefetch {row['prefetch_batches']}"
    print(f"{name:<28}{row['step_ms']:>12.2f}{row['wait_ms']:>10.3f}{row['wait_cpu_ms']:>11.3f}"
          f"{100 * row['wait_fraction']:>8.2f}%")
  defaults = data.DataConfig()
  default_row = next(row for row in results["data_wait"]
                     if (row["num_workers"], row["prefetch_batches"])
                     == (defaults.num_workers, defaults.prefetch_batches))
  target_met = default_row["wait_fraction"] < 0.02
  results["target_wait_fraction_below_2_percent"] = target_met
  print(f"data wait under 2% of the step with the default config: "
        f"{'yes' if target_met else 'NO'} ({100 * default_row['wait_fraction']:.2f}%)")
  common.write(results, args.out)
  return results


if __name__ == "__main__":  # Grain's worker processes re-import this module
  main(sys.argv[1:])
