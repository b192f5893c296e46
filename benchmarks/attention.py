"""Forward+backward time of each attention kernel that runs here, against a plain softmax.

In one process, at one shape, from the same inputs, this times

  reference   softmax(q k^T / sqrt(H) + mask) v, written in jax.numpy (the baseline)
  auto        kernels.attention(plan=resolve_plan()): what the models call
  <name>      each implementation eligible on this backend for this shape
              (`xla_blocked` too where "auto" passes it over, so that its
              rule can be checked)
  xla_blocked@<n>   with --block-sizes: the blocked kernel with n-row blocks
  torch_sdpa  when torch is importable (and the masks are at most causal):
              torch's scaled_dot_product_attention forward+backward on the
              device JAX runs on (CUDA when JAX runs on a GPU, the CPU when on
              the CPU; none otherwise: a kernel on one device against torch
              on another compares nothing), in the same rounds

and reports milliseconds, the ratio to the reference, the implementation "auto"
chose (marked *) and whether "auto" is within noise of the fastest eligible
one; "auto" and its choice compile to the same program, so the gap between
their two timings is the noise of the run. Pallas kernels that would run
interpreted on CPU are left out: they would time the interpreter, not the kernel.

Timing uses tokamax's benchmarking (wall clock on CPU, device timers on GPU and
TPU). Rounds interleave the variants so that noise from other work on a shared
machine hits them alike; each figure is the fastest run, since noise only ever
adds time.

    python benchmarks/attention.py                 # B8 T512 N8 K8 H64 f32 (issue #15's layer)
    python benchmarks/attention.py --shape 4,1024,8,8,64 --dtype bf16 --segment-ids
    python benchmarks/attention.py --block-sizes 64,128,256 --no-torch
    python benchmarks/attention.py --quick         # a tiny shape, one round: a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
from jax_ai_stack import kernels
from jax_ai_stack.errors import UsageError
from jax_ai_stack.kernels import autotuning, blocked, implementations
from jax_ai_stack.kernels.cli import parse_shape

NOISE_FLOOR = 0.05
"""Ratios within 5%, or within the noise measured in the run if larger, count as equal."""
QUICK_SHAPE = "2,64,2,1,16"
"""B,T,N,K,H of --quick: grouped heads, compiles in seconds."""


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


def torch_device(torch, platform: str) -> tuple[str | None, str | None]:
  """(torch's device on JAX's `platform`, None), or (None, why there is none).

  The comparison is only meaningful on one device: torch on "cuda" when JAX
  runs on a GPU (and torch sees one), on "cpu" when JAX runs on the CPU.
  """
  if platform == "cpu":
    return "cpu", None
  if platform == "gpu":
    if torch.cuda.is_available():
      return "cuda", None
    return None, ("JAX runs on a GPU but torch sees no CUDA device: torch on the CPU is no "
                  "comparison")
  return None, f"torch does not run on {platform}: no comparison on the same device"


def torch_sdpa_timer(request, inputs, platform: str | None = None):
  """(timer of torch's SDPA forward+backward on `inputs`, None), or (None, why not).

  The timer takes a number of runs and returns their milliseconds. torch gets
  the same values in its own [B, N, T, H] layout and a fixed cotangent, on the
  device JAX runs on (`platform`, default JAX's backend; see `torch_device`).
  The timer's `.device` names it.
  """
  try:
    import torch
  except ImportError:
    return None, "torch is not installed"
  if request.segment_ids or request.local_window is not None or request.kv_seq_lengths:
    return None, "torch SDPA is compared only with causal or no mask"
  if request.dtype not in ("float32", "bfloat16"):
    return None, f"torch SDPA is compared in float32 and bfloat16, not {request.dtype}"
  device, why_not = torch_device(torch, platform or jax.default_backend())
  if device is None:
    return None, why_not
  dtype = getattr(torch, request.dtype)
  q, k, v = (
      torch.from_numpy(np.array(x, np.float32)).to(device, dtype).transpose(1, 2).contiguous()
      .requires_grad_() for x in inputs[:3])
  cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
  gqa = request.num_heads != request.num_kv_heads
  synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def forward_backward():
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=request.causal, enable_gqa=gqa)
    torch.autograd.grad(out, (q, k, v), cotangent)

  def timer(iterations: int) -> list[float]:
    times = []
    for _ in range(iterations):
      synchronize()
      start = time.perf_counter()
      forward_backward()
      synchronize()  # GPU kernels run asynchronously: the time is theirs, not the launch's.
      times.append((time.perf_counter() - start) * 1e3)
    return times

  timer.device = device

  forward_backward()  # Warm-up, as the JAX variants are compiled first.
  return timer, None


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,512,8,8,64", metavar="B,T,N,K,H")
  parser.add_argument("--kv-len", type=int, metavar="S", help="key/value length (default: T)")
  parser.add_argument("--dtype", default="float32", help="float32/f32, bfloat16/bf16")
  parser.add_argument("--no-causal", dest="causal", action="store_false")
  parser.add_argument("--segment-ids", action="store_true")
  parser.add_argument("--local-window", type=int, metavar="W")
  parser.add_argument("--kv-seq-lengths", action="store_true")
  parser.add_argument("--iterations", type=int, default=3, help="timed runs per round")
  parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
  parser.add_argument("--block-sizes", default="", metavar="N,N",
                      help="also time xla_blocked with these query block sizes")
  parser.add_argument("--no-torch", dest="torch", action="store_false",
                      help="leave out torch's SDPA even where torch is importable")
  parser.add_argument("--quick", action="store_true",
                      help=f"shape {QUICK_SHAPE}, one run of one round: a smoke test")
  common.add_out_argument(parser, "attention")
  args = parser.parse_args(argv)
  if args.quick:
    args.shape, args.iterations, args.rounds = QUICK_SHAPE, 1, 1
  try:
    block_sizes = [int(n) for n in args.block_sizes.split(",") if n.strip()]
    if any(n < 1 for n in block_sizes):
      raise ValueError
  except ValueError:
    parser.error(f"--block-sizes {args.block_sizes!r} must be positive ints, e.g. 64,128")
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
  # Also those "auto" passes over for this shape (its measured rules), named here.
  ruled = [name for name, impl in kernels.IMPLEMENTATIONS.items() if impl.auto_check]
  candidates = kernels.report(request, [kernels.AUTO, *ruled], environ={})
  eligible = [name for name, interpret in choice.fallbacks + candidates.fallbacks
              if not interpret]
  eligible = list(dict.fromkeys(eligible))
  if block_sizes and "xla_blocked" not in eligible:
    parser.error(f"--block-sizes: xla_blocked does not run here: {candidates.report()}")
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

  for size in block_sizes:
    variants[f"xla_blocked@{size}"] = lambda q, k, v, ids, lengths, size=size: (
        blocked.blocked_attention(q, k, v, causal=args.causal, segment_ids=ids,
                                  local_window=args.local_window, block_size=size))

  inputs = autotuning.inputs(request)
  timer, torch_note = (None, "--no-torch") if not args.torch else torch_sdpa_timer(request, inputs)
  times = autotuning.time_forward_backward(
      variants, inputs, iterations=args.iterations, rounds=args.rounds,
      others={"torch_sdpa": timer} if timer else None)
  # "auto" traces to the very program of the implementation it chose, so the
  # gap between those two timings measures this machine's noise.
  fastest = min(eligible, key=times.get)
  noise = abs(times["auto"] - times[choice.name]) / min(times["auto"], times[choice.name])
  tolerance = max(NOISE_FLOOR, noise)
  auto_ms = min(times["auto"], times[choice.name])
  results = {
      **common.header("attention"),
      "device": choice.backend.describe(),
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
      "torch_sdpa": torch_note or "timed",
      "torch_device": timer.device if timer else None,
      "auto_over_torch_sdpa": auto_ms / times["torch_sdpa"] if timer else None,
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
  if timer:
    ratio = results["auto_over_torch_sdpa"]
    print(f"auto / torch SDPA (is_causal={args.causal}, torch on {timer.device}, the device JAX"
          f" runs on): {ratio:.2f}x (target <= 1: {common.verdict(ratio, 1.0)})")
  else:
    print(f"torch SDPA not timed: {torch_note}")
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
