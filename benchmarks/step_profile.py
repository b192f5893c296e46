"""Where the recipe's Llama train step spends its time, by kind of XLA op.

The step-level benchmark (`train_step.py`) says how fast the step is; this says
what to fix next. It runs a few steps of the recipe's step under
`jax.profiler`, where XLA reports one trace event per executed op (on a CPU
with `--xla_cpu_enable_xprof_traceme`, set here), finds each op's instruction
in the compiled HLO and sums the time by kind:

  matmul     fusions that hold a dot: the MLP, the q/k/v/o projections, the
             attention's QK^T and PV, the output head
  layout     fusions that only copy or transpose, and elementwise fusions that
             also write a transposed layout (the extra passes of a layout
             change between einsums)
  elementwise  the other loop fusions: norms, SiLU, RoPE, residuals, softmax,
             AdamW, the loss
  other      reductions, gathers, scatters and what else runs on its own

It prints the share of each kind and, per kind, the ops that took longest with
the JAX operation that emitted them (the HLO's `op_name`), so that an extra
pass can be traced back to a line of the model. Op times are summed: ops that
XLA runs side by side count in full, so the sum can exceed the step's wall time.

    python benchmarks/step_profile.py                 # tiny
    python benchmarks/step_profile.py --size medium   # slow on a CPU
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

# Before JAX starts its CPU backend: one trace event per executed op.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import common  # noqa: E402
import train_step  # noqa: E402
from jax_ai_stack.recipes import step  # noqa: E402
from jax_ai_stack.recipes.tasks import lm_loss  # noqa: E402

KINDS = ("matmul", "layout", "elementwise", "other")
TOP_OPS = 8
"""Ops listed per kind."""
_IGNORED = {"parameter", "constant", "bitcast", "broadcast", "tuple", "get-tuple-element"}


def computations(hlo: str) -> dict[str, str]:
  """{name: body} of every computation in an HLO module's text."""
  bodies = {}
  for block in hlo.split("\n\n"):
    match = re.match(r"\s*(?:ENTRY )?%?([\w.\-]+) ", block)
    if match:
      bodies[match.group(1)] = block
  return bodies


def instructions(hlo: str) -> dict[str, dict[str, str]]:
  """{name: {"kind": ..., "shape": ..., "source": op_name}} of the ops the step runs."""
  bodies = computations(hlo)
  found = {}
  for match in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w-]+)\((.*)$", hlo, re.MULTILINE):
    name, shape, opcode, rest = match.groups()
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    ops = set(re.findall(r"= \S+ ([\w-]+)\(", bodies.get(called.group(1), ""))) if called else set()
    source = re.search(r'op_name="([^"]*)"', rest)
    found[name] = {"kind": kind_of(opcode, ops - _IGNORED), "shape": shape,
                   "source": source.group(1) if source else ""}
  return found


def kind_of(opcode: str, fused_ops: set[str]) -> str:
  """One of KINDS for an op (`fused_ops`: the ops inside it, if it is a fusion)."""
  if opcode in ("dot", "convolution", "custom-call") or {"dot", "convolution"} & fused_ops:
    return "matmul"
  if opcode == "fusion" and fused_ops & {"copy", "transpose"}:
    return "layout"
  if opcode == "fusion" and not fused_ops & {"reduce", "reduce-window", "scatter", "gather"}:
    return "elementwise"
  if opcode in ("copy", "transpose"):
    return "layout"
  return "other"


def op_times(trace_dir: pathlib.Path) -> dict[str, float]:
  """{event name: total seconds} of the complete events in the profiler's trace."""
  path = next(trace_dir.rglob("*.trace.json.gz"))
  totals = collections.Counter()
  for event in json.load(gzip.open(path))["traceEvents"]:
    if event.get("ph") == "X":
      totals[event["name"]] += event.get("dur", 0) / 1e6
  return totals


def profile(size: train_step.Size, steps: int) -> dict[str, Any]:
  """Time per kind of op, per step, of the recipe's step at `size`."""
  batch = train_step.make_batch(size)
  model, tx = train_step._fresh(size)  # noqa: SLF001 - the benchmark's shared init.
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train, _, state = step.make_steps(model, optimizer, lm_loss)
  ops = instructions(train.lower(state, batch).compile().as_text())
  for _ in range(2):  # Compiles and warms up.
    state, metrics = train(state, batch)
  jax.block_until_ready(state)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        state, metrics = train(state, batch)
      jax.block_until_ready(state)
    times = op_times(pathlib.Path(trace_dir))
  seen = {name: seconds / steps for name, seconds in times.items() if name in ops}
  if not seen:
    raise RuntimeError("the profiler's trace names none of the step's HLO ops: this backend "
                       "does not report per-op events to jax.profiler")
  per_kind = {kind: 0.0 for kind in KINDS}
  top = {kind: [] for kind in KINDS}
  for name, seconds in sorted(seen.items(), key=lambda item: -item[1]):
    kind = ops[name]["kind"]
    per_kind[kind] += seconds
    if len(top[kind]) < TOP_OPS:
      top[kind].append({"op": name, "ms": seconds * 1e3, "shape": ops[name]["shape"],
                        "source": ops[name]["source"]})
  total = sum(per_kind.values())
  return {
      "steps_profiled": steps,
      "ops_timed": len(seen),
      "op_ms_per_step": total * 1e3,
      "kinds": {kind: {"ms": s * 1e3, "share": s / total} for kind, s in per_kind.items()},
      "outside_matmuls_share": 1 - per_kind["matmul"] / total,
      "top_ops": top,
  }


def print_profile(name: str, result: dict[str, Any]) -> None:
  print(f"\n{name}: {result['op_ms_per_step']:.1f} ms of ops per step "
        f"({result['ops_timed']} ops), {result['outside_matmuls_share']:.0%} outside matmuls")
  for kind, row in result["kinds"].items():
    print(f"  {kind:12s} {row['ms']:8.1f} ms  {row['share']:6.1%}")
  for kind, ops in result["top_ops"].items():
    print(f"  longest {kind} ops:")
    for op in ops:
      print(f"    {op['ms']:7.2f} ms  {op['shape'][:28]:28s} {op['source'][-90:]}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=sorted(train_step.SIZES), default="tiny")
  parser.add_argument("--steps", type=common.positive_int, default=5,
                      help="steps under the profiler (default 5)")
  parser.add_argument("--quick", action="store_true", help="the quick size, 1 step: a smoke test")
  common.add_out_argument(parser, "step_profile")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  size_name, steps = ("quick", 1) if args.quick else (args.size, args.steps)
  result = profile(train_step.SIZES[size_name], steps)
  print_profile(size_name, result)
  record = {**common.header("step_profile"), "size": size_name, **result}
  common.write(record, args.out)
  return record


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
