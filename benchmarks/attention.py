"""Forward+backward time of each attention kernel that runs here, against a plain softmax.

In one process, at one shape, from the same inputs, this times

  reference   softmax(q k^T / sqrt(H) + mask) v, written in jax.numpy (the baseline)
  auto        kernels.attention(plan=resolve_plan()): what the models call
  <name>      each implementation eligible on this backend for this shape

and reports milliseconds, the ratio to the reference, the implementation "auto"
chose (marked *) and whether "auto" is within noise of the fastest eligible
one; "auto" and its choice compile to the same program, so the gap between
their two timings is the noise of the run. Pallas kernels that would run interpreted on CPU are left out: they would
time the interpreter, not the kernel.

Timing uses tokamax's benchmarking (wall clock on CPU, device timers on GPU and
TPU). Rounds interleave the variants so that noise from other work on a shared
machine hits them alike; each figure is the fastest run, since noise only ever
adds time.

    python benchmarks/attention.py                                # B2 T1024 N8 K8 H64 f32
    python benchmarks/attention.py --shape 4,1024,8,8,64 --dtype bf16 --segment-ids
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_ai_stack import kernels
from jax_ai_stack.errors import UsageError
from jax_ai_stack.kernels import autotuning, implementations
from jax_ai_stack.kernels.cli import parse_shape

RESULTS_PATH = pathlib.Path(__file__).parent / "results" / "attention.json"
NOISE_FLOOR = 0.05
"""Ratios within 5%, or within the noise measured in the run if larger, count as equal."""


def reference_attention(q, k, v, ids, lengths, *, causal, local_window):
  """The plain softmax every kernel must match, and the speed baseline."""
  _, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  group = num_heads // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(head_dim).astype(q.dtype)
  i, j = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
  allowed = jnp.ones((1, 1, q_len, kv_len), bool)
  if causal:
    allowed &= j <= i
  if local_window is not None:
    allowed &= (j >= i - local_window) & (j <= i)
  if ids is not None:
    allowed &= ids[:, None, :, None] == ids[:, None, None, :]
  if lengths is not None:
    allowed &= j < lengths[:, None, None, None]
  logits = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="2,1024,8,8,64", metavar="B,T,N,K,H")
  parser.add_argument("--kv-len", type=int, metavar="S", help="key/value length (default: T)")
  parser.add_argument("--dtype", default="float32", help="float32/f32, bfloat16/bf16")
  parser.add_argument("--no-causal", dest="causal", action="store_false")
  parser.add_argument("--segment-ids", action="store_true")
  parser.add_argument("--local-window", type=int, metavar="W")
  parser.add_argument("--kv-seq-lengths", action="store_true")
  parser.add_argument("--iterations", type=int, default=3, help="timed runs per round")
  parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
  parser.add_argument("--output", type=pathlib.Path, default=RESULTS_PATH)
  args = parser.parse_args(argv)
  try:
    q_shape, k_shape = parse_shape(args.shape, args.kv_len)
  except UsageError as e:
    parser.error(str(e))
  try:
    request = kernels.Request.from_shapes(
        q_shape, k_shape, args.dtype, causal=args.causal, segment_ids=args.segment_ids,
        local_window=args.local_window, kv_seq_lengths=args.kv_seq_lengths)
  except ValueError as e:
    parser.error(str(e))
  plan = kernels.resolve_plan()  # What the models run: JAX_AI_STACK_ATTENTION, else "auto".
  choice = plan.report(request)
  eligible = [name for name, interpret in choice.fallbacks if not interpret]
  if not eligible:
    parser.exit(1, choice.report() + "\nerror: no attention implementation runs here\n")
  variants = {
      "reference": lambda q, k, v, ids, lengths: reference_attention(
          q, k, v, ids, lengths, causal=args.causal, local_window=args.local_window),
      "auto": lambda q, k, v, ids, lengths: kernels.attention(
          q, k, v, causal=args.causal, segment_ids=ids, local_window=args.local_window,
          kv_seq_lengths=lengths, plan=plan),
  }
  for name in eligible:
    run = kernels.IMPLEMENTATIONS[name].run
    variants[name] = lambda q, k, v, ids, lengths, run=run: implementations.call(
        run, request, q, k, v, ids, lengths)

  inputs = autotuning.inputs(request)
  times = autotuning.time_forward_backward(
      variants, inputs, iterations=args.iterations, rounds=args.rounds)
  # "auto" traces to the very program of the implementation it chose, so the
  # gap between those two timings measures this machine's noise.
  fastest = min(eligible, key=times.get)
  noise = abs(times["auto"] - times[choice.name]) / min(times["auto"], times[choice.name])
  tolerance = max(NOISE_FLOOR, noise)
  auto_ms = min(times["auto"], times[choice.name])
  results = {
      "device": choice.backend.describe(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "request": request.to_dict(),
      "chosen": choice.name,
      "iterations": args.iterations,
      "rounds": args.rounds,
      "times_ms": times,
      "ratio_to_reference": {name: ms / times["reference"] for name, ms in times.items()},
      "fastest_eligible": fastest,
      "measured_noise": noise,
      "auto_over_fastest": auto_ms / times[fastest],
      "auto_within_noise": auto_ms <= times[fastest] * (1 + tolerance),
  }

  print(f"attention forward+backward on {results['device']}: {request.describe()}")
  print(f"{'variant':<22}{'ms':>10}{'vs reference':>14}")
  for name, ms in times.items():
    mark = "*" if name == choice.name else " "
    print(f"{mark} {name:<20}{ms:>10.2f}{results['ratio_to_reference'][name]:>13.2f}x")
  verdict = "within noise of" if results["auto_within_noise"] else "SLOWER than"
  print(f"auto runs {choice.name} (* above; the same program: their timings differ by"
        f" {noise:.0%}, the noise here). auto is {results['auto_over_fastest']:.2f}x the"
        f" fastest eligible ({fastest}): {verdict} it (tolerance {tolerance:.0%}).")
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(json.dumps(results, indent=2) + "\n")
  print(f"wrote {args.output}")
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
