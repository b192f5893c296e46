"""Compile time of the Llama train step against depth: unrolled vs `scan_layers`.

Unrolled, XLA sees every block's ops once per layer, so tracing and compiling
grow with `num_layers`; with `model.scan_layers=true` the blocks run under one
`nnx.scan` and XLA compiles one block, whatever the depth. This builds the
train step (forward, backward, AdamW update) of a narrow Llama abstractly (no
weights are allocated) and times `jax.jit(step).lower(...).compile()` at each
depth, both ways; it reports scanned / unrolled wall time per depth (target at
the deepest, 32 layers: <= 0.25).

    python benchmarks/compile_depth.py            # 4, 16, 32 layers (about 1 min on 2 cores)
    python benchmarks/compile_depth.py --quick    # 2 and 4 layers: a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import common
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

TARGET_RATIO = 0.25
"""At 32 layers, the scanned step may take at most a quarter of the unrolled compile time."""
DEPTHS, QUICK_DEPTHS = (4, 16, 32), (2, 4)
WIDTH = dict(vocab_size=256, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
             max_seq_len=64, attention_impl="xla")
BATCH, SEQ = 2, 32


def compile_seconds(num_layers: int, scan_layers: bool) -> dict[str, float]:
  """Wall time to lower and to compile one train step at this depth."""
  config = DecoderConfig(num_layers=num_layers, scan_layers=scan_layers, **WIDTH)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
  tx = optax.adamw(1e-3)
  opt_state = jax.eval_shape(tx.init, params)
  tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  started = time.perf_counter()
  lowered = jax.jit(train_step).lower(params, opt_state, tokens)
  lowered_at = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return {"lower_s": lowered_at - started, "compile_s": done - lowered_at,
          "total_s": done - started}


def run(args: argparse.Namespace) -> dict[str, Any]:
  rows = []
  for depth in args.depths:
    unrolled = compile_seconds(depth, scan_layers=False)
    scanned = compile_seconds(depth, scan_layers=True)
    rows.append({"num_layers": depth, "unrolled": unrolled, "scanned": scanned,
                 "ratio": scanned["total_s"] / unrolled["total_s"]})
    print(f"{depth} layers: unrolled {unrolled['total_s']:.2f} s, scanned "
          f"{scanned['total_s']:.2f} s", flush=True)
  deepest = rows[-1]
  return {
      **common.header("compile_depth"),
      "quick": args.quick,
      "model": {**WIDTH, "batch": BATCH, "seq_len": SEQ},
      "rows": rows,
      "deepest_ratio": deepest["ratio"],
      "target_ratio": TARGET_RATIO,
      "met_target": None if args.quick else deepest["ratio"] <= TARGET_RATIO,
  }


def print_table(results: dict[str, Any]) -> None:
  print(f"\n{'layers':>6} {'unrolled':>9} {'scanned':>9} {'scanned/unrolled':>17}")
  for row in results["rows"]:
    print(f"{row['num_layers']:6d} {row['unrolled']['total_s']:8.2f}s "
          f"{row['scanned']['total_s']:8.2f}s {row['ratio']:17.2f}")
  deepest = results["rows"][-1]["num_layers"]
  if results["met_target"] is None:
    print(f"(--quick: the target, <= {TARGET_RATIO} at 32 layers, is not judged)")
  else:
    verdict = common.verdict(results["deepest_ratio"], TARGET_RATIO)
    print(f"scanned / unrolled lower + compile time at {deepest} layers = "
          f"{results['deepest_ratio']:.2f} (target <= {TARGET_RATIO}: {verdict})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/compile_depth.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"smoke test: depths {QUICK_DEPTHS}")
  common.add_out_argument(parser, "compile_depth")
  args = parser.parse_args(argv)
  args.depths = QUICK_DEPTHS if args.quick else DEPTHS
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
