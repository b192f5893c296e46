"""Does a sliding window make attention cheaper? Windowed against full causal, same kernel.

Mistral, Qwen2 and the local layers of Gemma 2 and 3 attend to the last W
keys only. The kernels take that window in their request (`local_window`;
a Hugging Face `sliding_window` of W is a local window of W - 1 keys before
the query), and the blocked kernel that "auto" picks on a CPU skips the key
blocks outside it. This times, in one process, from the same inputs, the
attention the models call (`kernels.attention` through the resolved plan)
forward+backward:

  causal     full causal attention (the baseline)
  windowed   the same with the window
  reference  the windowed attention as a dense masked softmax (it computes
             every score, so it costs what full attention costs)

and reports windowed / causal (**target: at least 3x faster** at T 4096 and a
256-token window, where the window leaves about 5x fewer key blocks).

    python benchmarks/sliding_window.py                   # B1 T4096 N8 K4 H64 f32, window 256
    python benchmarks/sliding_window.py --shape 1,8192,8,4,64 --window 1024
    python benchmarks/sliding_window.py --quick           # a tiny shape: a smoke test
"""

from __future__ import annotations

import argparse
import sys

import common
from attention import reference_attention
from jax_ai_stack import kernels
from jax_ai_stack.errors import UsageError
from jax_ai_stack.kernels import autotuning
from jax_ai_stack.kernels.cli import parse_shape

TARGET_SPEEDUP = 3.0
"""Windowed forward+backward at least this many times faster than full causal."""
QUICK = ("1,256,2,1,16", 32)
"""--quick's shape and window: compiles in seconds."""


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="1,4096,8,4,64", metavar="B,T,N,K,H")
  parser.add_argument("--window", type=int, default=256,
                      help="Hugging Face's sliding_window: each query sees this many keys")
  parser.add_argument("--dtype", default="float32", help="float32/f32, bfloat16/bf16")
  parser.add_argument("--iterations", type=int, default=2, help="timed runs per round")
  parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
  parser.add_argument("--quick", action="store_true", help="a tiny shape, one run: a smoke test")
  common.add_out_argument(parser, "sliding_window")
  args = parser.parse_args(argv)
  if args.quick:
    (args.shape, args.window), args.iterations, args.rounds = QUICK, 1, 1
  if args.window < 1:
    parser.error(f"--window {args.window} must be at least 1")
  try:
    q_shape, k_shape = parse_shape(args.shape, None)
  except UsageError as e:
    parser.error(str(e))
  local_window = args.window - 1  # The query itself and the W - 1 keys before it.
  requests = {
      name: kernels.Request.from_shapes(q_shape, k_shape, args.dtype, causal=True,
                                        local_window=window)
      for name, window in (("causal", None), ("windowed", local_window))}
  plan = kernels.resolve_plan()
  chosen = {name: plan.report(request).name for name, request in requests.items()}

  def attend(window):
    return lambda q, k, v, ids, lengths: kernels.attention(
        q, k, v, causal=True, local_window=window, plan=plan)

  variants = {
      "causal": attend(None),
      "windowed": attend(local_window),
      "reference": lambda q, k, v, ids, lengths: reference_attention(
          q, k, v, ids, lengths, causal=True, local_window=local_window),
  }
  times = autotuning.time_forward_backward(
      variants, autotuning.inputs(requests["causal"]), iterations=args.iterations,
      rounds=args.rounds)
  speedup = times["causal"] / times["windowed"]
  results = {
      **common.header("sliding_window"),
      "request": requests["windowed"].to_dict(),
      "sliding_window": args.window,
      "chosen": chosen,
      "iterations": args.iterations,
      "rounds": args.rounds,
      "times_ms": times,
      "targets": {"windowed_speedup": common.target(speedup, TARGET_SPEEDUP, at_least=True)},
  }
  print(f"attention forward+backward on {results['device']}: "
        f"{requests['windowed'].describe()} (sliding_window {args.window})")
  print(f"{'variant':<12}{'implementation':<18}{'ms':>10}")
  for name, ms in times.items():
    print(f"{name:<12}{chosen.get(name, 'dense softmax'):<18}{ms:>10.2f}")
  print(f"windowed is {speedup:.2f}x faster than full causal (target >= {TARGET_SPEEDUP:g}x:"
        f" {common.verdict(speedup, TARGET_SPEEDUP, at_least=True)})")
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
