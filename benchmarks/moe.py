"""A MoE layer's grouped matmul against a dense MLP of the same active parameters.

In one process, on the same tokens, it times the jitted forward and backward
pass (gradients of every weight) of

  moe-<impl>  `models.moe.MoE`: E experts of F hidden units, k per token, each
              grouped matmul run by <impl> (tokamax, xla, blocked; `kernels.grouped_matmul`)
  moe-dense   the same layer with every expert on every token, masked (the
              reference: E / k times the expert FLOPs)
  dense       a dense gated MLP of k * F hidden units: what one token computes in
              the MoE layer, without routing (the baseline)

and reports the median ms per pass and each one's ratio to the dense baseline.
The MoE layer does the dense MLP's FLOPs plus the router's, and pays for sorting
the tokens by expert and unsorting them; the target is a ratio of at most
`TARGET_VS_DENSE` for the best grouped matmul. On a CPU, XLA's ragged_dot runs
each group as its own dot, so small groups lose there; GPUs and TPUs run
tokamax's Mosaic / Triton kernels.

    python benchmarks/moe.py               # 8 experts, top 2, 4096 tokens of width 256
    python benchmarks/moe.py --quick       # smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.configs import DecoderConfig, MoeConfig
from jax_ai_stack.recipes.models.decoder import MLP
from jax_ai_stack.recipes.models.moe import MoE

TARGET_VS_DENSE = 2.0
"""The best grouped matmul's pass may take at most this many times the dense MLP's."""
SIZES = {"full": dict(tokens=4096, d_model=256, expert_mlp_dim=256, experts=8, top_k=2),
         "quick": dict(tokens=64, d_model=16, expert_mlp_dim=16, experts=4, top_k=2)}


def _config(size: dict[str, int], grouped_matmul: str = "auto", *, dense: bool = False):
  if dense:
    return DecoderConfig(d_model=size["d_model"], mlp_dim=size["top_k"] * size["expert_mlp_dim"])
  return DecoderConfig(kind="mixtral", d_model=size["d_model"], mlp_dim=size["expert_mlp_dim"],
                       moe=MoeConfig(num_experts=size["experts"],
                                     num_experts_per_tok=size["top_k"],
                                     grouped_matmul=grouped_matmul))


def layers(size: dict[str, int]) -> dict[str, nnx.Module]:
  rngs = lambda: nnx.Rngs(0)  # noqa: E731
  with eager_sharding_scope():  # No mesh: the logical axis names stay metadata.
    out = {"dense": MLP(_config(size, dense=True), rngs=rngs())}
  for impl in ("tokamax", "xla", "blocked", "dense"):
    out[f"moe-{impl}"] = MoE(_config(size, impl), rngs=rngs())
  return out


def pass_of(layer: nnx.Module):
  """The jitted forward and backward pass of `layer` on tokens, and its state."""
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    out = nnx.merge(graphdef, state)(x)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.mean(out.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss)), state


def bench(size: dict[str, int], rounds: int) -> dict[str, list[float]]:
  x = jnp.asarray(np.random.default_rng(0).normal(size=(size["tokens"], size["d_model"])),
                  jnp.float32)
  runs = {name: pass_of(layer) for name, layer in layers(size).items()}
  calls = {name: functools.partial(run, state, x) for name, (run, state) in runs.items()}
  for call in calls.values():
    jax.block_until_ready(call())  # Compiles.
  return common.interleaved_ms(calls, rounds)


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
  base = statistics.median(times["dense"])
  variants = {name: {"ms_per_pass": statistics.median(ms),
                     "vs_dense": statistics.median(ms) / base, "ms_rounds": ms}
              for name, ms in times.items()}
  best = min(("moe-tokamax", "moe-xla", "moe-blocked"), key=lambda n: variants[n]["ms_per_pass"])
  return {"variants": variants, "best_grouped_matmul": best,
          "best_vs_dense": common.target(variants[best]["vs_dense"], TARGET_VS_DENSE)}


def print_table(results: dict[str, Any]) -> None:
  print(f"\n{results['layer']} on {results['device']}; median of {results['rounds']} rounds")
  rows = [("variant", "ms/pass", "x dense")]
  for name, r in results["variants"].items():
    rows.append((name, f"{r['ms_per_pass']:.2f}", f"{r['vs_dense']:.2f}"))
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  for row in rows:
    print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
  judged = results["best_vs_dense"]
  print(f"best grouped matmul {results['best_grouped_matmul']}: {judged['value']:.2f} x dense, "
        f"target <= {judged['target']}: "
        f"{common.verdict(judged['value'], judged['target'])}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/moe.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=common.positive_int, default=10,
                      help="timed rounds (default: 10)")
  parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 2 rounds")
  common.add_out_argument(parser, "moe")
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds = 2
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  size = SIZES["quick" if args.quick else "full"]
  results = {
      **common.header("moe"),
      "layer": (f"{size['experts']} experts, top {size['top_k']}, {size['tokens']} tokens of "
                f"width {size['d_model']}, {size['expert_mlp_dim']} hidden units per expert"),
      "rounds": args.rounds, "quick": args.quick,
      **summarize(bench(size, args.rounds)),
  }
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
