"""The memory plan against XLA's per-device bytes, recipe x topology, compiled ahead of time.

Each row compiles a recipe's programs for a TPU slice or GPU host this machine does not
have (`recipes.aot.compile_recipe`: compile-only devices, abstract state, no weights) and
sets the memory plan (`memory.estimate_memory` on the same mesh and kernel) beside XLA's
bytes of the largest program. The plan must be within 15% of XLA (issue 60): the ratio
column says how far it is. Real sizes are the presets with the shapes of Llama-3-8B,
Qwen3-30B-A3B, Gemma 3 12B and Qwen3-8B as overrides; nothing of them is allocated.

    python benchmarks/aot_table.py                      # every row (about 30 min on 2 cores)
    python benchmarks/aot_table.py --rows small         # the presets only
    python benchmarks/aot_table.py --rows lm-tiny@v5e:2x2 qwen3-tiny@v6e:2x2

It writes the rows as JSON (--out) and the table as markdown beside it (.md), the table
docs/scaling.md shows (`--markdown ROWS.json` prints it again from rows already measured).
A row more than 15% off must be in `EXPLAINED`, with the reason; `unexplained` lists the
others, and tests/test_aot_table.py fails on them. It needs libtpu (and the CUDA plugin for the h100 row) at the
row's pin; a row that cannot compile says why in its `error`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import common

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # Compile-only: no chip to share.
TOLERANCE = 0.15
"""How far the plan may be from XLA's per-device bytes (issue 60)."""
SMALL = ("lm-tiny", "moe-tiny", "qwen3-tiny", "gemma3-tiny", "lm-tiny-grpo")
SLICES = ("v5e:2x2", "v5e:2x4", "v5p:2x2x1", "v5p:2x2x2", "v6e:2x2", "v6e:2x4", "h100:8")
"""4 and 8 chips of each TPU generation (a v5p-8 is 4 chips: 2 TensorCores each), and an
8-GPU host."""
PRESET_OVERRIDES = {"moe-tiny": ("mesh.expert=2",)}
EXPLAINED = {
    "moe-tiny@h100:8": (
        "the plan's activations are one device's step, compiled alone: it has no exchange. "
        "Over mesh.expert=2 each device's MoE layers take both devices' tokens (the "
        "all-gather dispatcher). And it compiles XLA's ragged_dot, what this host compiles for "
        "a GPU it does not have, where a real H100 runs tokamax's kernel. Not counted; the TPU "
        "rows, with megablox, are within 15%"),
    **dict.fromkeys(("llama3-8b-unrolled@v5p:2x2x1", "gemma3-12b@v5p:2x2x2"), (
        "unrolled layers: XLA:TPU's scheduler starts every layer's weight all-gather early "
        "because the chip's HBM has room (at the peak each layer's gathered weights are live), "
        "a choice, not a need; with its memory limit lowered to the plan "
        "(LIBTPU_INIT_ARGS=--xla_tpu_scheduler_percent_shared_memory_limit=17) Gemma 3 12B "
        "compiles at 16.69 GiB, 1.05 of the plan. A scanned model gathers one layer at a "
        "time")),
}
"""Rows whose plan is more than `TOLERANCE` from XLA, and why that is right (docs/scaling.md
says more). A row out of tolerance and not here is a failure (`unexplained`)."""

BIG = ("model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.remat=full",
       "mesh.rules=fsdp", "mesh.data=1")
LLAMA3_8B = ("model.vocab_size=128256", "model.d_model=4096", "model.num_layers=32",
             "model.num_heads=32", "model.num_kv_heads=8", "model.mlp_dim=14336",
             "model.rope_theta=500000", "model.tie_embeddings=false",
             "model.max_seq_len=8192", "data.seq_len=8192", *BIG, "mesh.fsdp=-1")
QWEN3_30B_A3B = ("model.kind=qwen3_moe", "model.vocab_size=151936", "model.d_model=2048",
                 "model.num_layers=48", "model.num_heads=32", "model.num_kv_heads=4",
                 "model.head_dim=128", "model.mlp_dim=6144", "model.tie_embeddings=false",
                 "model.rope_theta=1000000", "model.moe={num_experts: 128, "
                 "num_experts_per_tok: 8, expert_mlp_dim: 768, norm_topk_prob: true}",
                 "model.max_seq_len=4096", "data.seq_len=4096", "model.scan_layers=true",
                 *BIG, "mesh.fsdp=2", "mesh.expert=-1")
GEMMA3_12B = ("model.vocab_size=262144", "model.d_model=3840", "model.num_layers=48",
              "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=256",
              "model.mlp_dim=15360", "model.query_pre_attn_scalar=256",
              "model.sliding_window=1024",
              "model.layer_types=[" + ",".join((["sliding"] * 5 + ["full"]) * 8) + "]",
              "model.max_seq_len=4096", "data.seq_len=4096", *BIG, "mesh.fsdp=-1")
QWEN3_8B = ("model.kind=qwen3", "model.vocab_size=151936", "model.d_model=4096",
            "model.num_layers=36", "model.num_heads=32", "model.num_kv_heads=8",
            "model.head_dim=128", "model.mlp_dim=12288", "model.tie_embeddings=false",
            "model.rope_theta=1000000", "model.max_seq_len=2048", "data.seq_len=1024",
            "rl.max_completion_tokens=1024", "model.scan_layers=true", *BIG, "mesh.fsdp=-1")


@dataclasses.dataclass(frozen=True)
class Row:
  """One recipe on one topology, with its overrides."""

  name: str
  recipe: str
  topology: str
  overrides: tuple[str, ...] = ()

  @property
  def id(self) -> str:
    return f"{self.name}@{self.topology}"


def rows() -> list[Row]:
  """The table's rows: the presets on every slice, then the real sizes."""
  small = [Row(recipe, recipe, where, PRESET_OVERRIDES.get(recipe, ()))
           for recipe in SMALL for where in SLICES]
  scanned = (*LLAMA3_8B, "model.scan_layers=true")
  return small + [
      Row("llama3-8b", "lm-tiny", "v5p:2x2x1", (*scanned, "data.batch_size=4")),
      Row("llama3-8b-unrolled", "lm-tiny", "v5p:2x2x1", (*LLAMA3_8B, "data.batch_size=4")),
      Row("llama3-8b", "lm-tiny", "v5e:4x4", (*scanned, "data.batch_size=16")),
      Row("qwen3-30b-a3b", "moe-tiny", "v5p:2x2x2", (*QWEN3_30B_A3B, "data.batch_size=8")),
      Row("gemma3-12b", "gemma3-tiny", "v5p:2x2x2", (*GEMMA3_12B, "data.batch_size=8")),
      Row("qwen3-8b-grpo", "lm-tiny-grpo", "v6e:2x4",
          (*QWEN3_8B, "data.batch_size=8", "rl.num_generations=2")),
  ]


def measure(row: Row) -> dict[str, Any]:
  """The row compiled: plan and XLA bytes per device, their ratio, fit, time, roofline.

  XLA's bytes of a program are `aot.Program.total` (its peak heap and code where XLA
  reports a peak, as on TPU). The train step's are compared with the plan (of the train
  step, its code a line); whether the run fits is the largest program's, or what an RL run
  holds while it samples (`aot.Compiled.sampling`: the engine beside the train state), if
  more."""
  from jax_ai_stack import topology  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import aot, config  # pylint: disable=g-import-not-at-top

  record: dict[str, Any] = {"row": row.id, "recipe": row.name, "topology": row.topology,
                            "overrides": list(row.overrides)}
  try:
    target = topology.load(row.topology)
    compiled = aot.compile_recipe(config.load(row.recipe, overrides=list(row.overrides)),
                                  target, environ={})
  except Exception as e:  # pylint: disable=broad-except  # A row's failure is its result.
    record["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    print(f"{row.id}: {record['error']}", flush=True)
    return record
  xla = {p.name: p.total for p in compiled.programs}
  largest = compiled.largest
  train = compiled.train
  plan, chip = compiled.plan, target.chip
  sampling = compiled.sampling
  most = max(xla[largest.name], sampling or 0)
  roofline = train.roofline(chip)
  record.update(
      chip=chip.device_kind, devices=len(target.devices), hbm=chip.hbm_bytes,
      attention=compiled.attention.name if compiled.attention else None,
      grouped_matmul=compiled.grouped_matmul[0],
      plan=plan.total, plan_lines=_plan_lines(plan), activations_from=plan.activations_from,
      xla=xla[train.name], largest=largest.name, programs=xla,
      xla_lines={"arguments": train.arguments, "outputs": train.outputs,
                 "aliased": train.aliased, "temporaries": train.temporaries,
                 "code": train.code, "peak": train.peak},
      sampling=sampling, most=most,
      ratio=xla[train.name] / max(plan.total, 1), fits=most <= chip.hbm_bytes,
      compile_seconds={p.name: p.seconds for p in compiled.programs},
      mfu_ceiling=roofline[1] if roofline else None)
  print(f"{row.id}: plan {_gib(plan.total)}, XLA {_gib(xla[train.name])} (largest: "
        f"{largest.name}, {_gib(most)} at most), "
        f"ratio {record['ratio']:.2f}, compiled in {sum(record['compile_seconds'].values()):.1f} s",
        flush=True)
  return record


def replan(record: dict[str, Any]) -> dict[str, Any]:
  """`record` with the memory plan made again by this checkout's `memory.estimate_memory`
  (same mesh, kernel and compiled code), XLA's numbers kept: a change to the plan does not
  change the programs XLA compiled."""
  from jax_ai_stack import topology  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import config, memory  # pylint: disable=g-import-not-at-top

  if "error" in record:
    return record
  (row,) = select([record["row"]])
  plan = memory.estimate_memory(config.load(row.recipe, overrides=list(row.overrides)),
                                topology.load(row.topology), attention=record["attention"],
                                environ={})
  plan = dataclasses.replace(plan, code=record["xla_lines"]["code"])
  return {**record, "plan": plan.total, "plan_lines": _plan_lines(plan),
          "activations_from": plan.activations_from, "ratio": record["xla"] / max(plan.total, 1)}


def _plan_lines(plan: Any) -> dict[str, int]:
  return {"parameters": plan.parameters, "reference": plan.reference,
          "optimizer": plan.optimizer, "gradients": plan.gradients, "gathered": plan.gathered,
          "activations": plan.activations, "code": plan.code}


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def unexplained(records: Sequence[dict[str, Any]]) -> list[str]:
  """The ids of the rows whose plan is more than `TOLERANCE` from XLA and not `EXPLAINED`."""
  return [r["row"] for r in records if "error" not in r
          and abs(r["ratio"] - 1) > TOLERANCE and r["row"] not in EXPLAINED]


def markdown(records: Sequence[dict[str, Any]]) -> str:
  """The rows as the markdown table docs/scaling.md shows: a ratio more than `TOLERANCE`
  from 1 marked `*`, or `†` and the reason under the table where `EXPLAINED`."""
  lines = ["| recipe | topology | plan / device | XLA / device | XLA / plan | fits | "
           "compile s | MFU ceiling |", "|---|---|---|---|---|---|---|---|"]
  reasons = []
  for r in records:
    if "error" in r:
      lines.append(f"| {r['recipe']} | {r['topology']} | | | | | | {r['error']} |")
      continue
    off = abs(r["ratio"] - 1) > TOLERANCE
    why = EXPLAINED.get(r.get("row", "")) if off else None
    if why:
      reasons.append(f"† {r['recipe']} on {r['topology']}: {why}.")
    ratio = f"{r['ratio']:.2f}" + ("" if not off else " †" if why else " *")
    fits = "yes" if r["fits"] else f"no ({_gib(r['hbm'])})"
    mfu = "" if r["mfu_ceiling"] is None else f"{r['mfu_ceiling']:.0%}"
    lines.append(f"| {r['recipe']} | {r['topology']} | {_gib(r['plan'])} | {_gib(r['xla'])} | "
                 f"{ratio} | {fits} | {sum(r['compile_seconds'].values()):.1f} | {mfu} |")
  return "\n".join(lines) + "\n" + "".join(f"\n{reason}\n" for reason in reasons)


def select(names: Sequence[str]) -> list[Row]:
  """The rows `names` ask for: ids (`lm-tiny@v5e:2x2`), "small", "large", or all."""
  every = rows()
  if not names:
    return every
  chosen = []
  for name in names:
    if name in ("small", "large"):
      chosen += [r for r in every if (r.name in SMALL) == (name == "small")]
    else:
      found = [r for r in every if r.id == name]
      if not found:
        raise SystemExit(f"no row {name!r}; rows: {', '.join(r.id for r in every)}")
      chosen += found
  return chosen


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", nargs="*", default=[],
                      help="row ids (recipe@topology), 'small' or 'large'; default: all")
  parser.add_argument("--replan", type=pathlib.Path, metavar="JSON",
                      help="make the plan of rows already measured again (compiling no program "
                           "but a small model's one-device step) and write them to --out")
  parser.add_argument("--markdown", type=pathlib.Path, metavar="JSON",
                      help="print the table of rows already measured (this script's JSON), "
                           "compiling nothing")
  common.add_out_argument(parser, "aot_table")
  args = parser.parse_args(argv)
  if args.markdown:
    records = json.loads(args.markdown.read_text())["rows"]
    print(markdown(records), end="")
    return {"rows": records, "unexplained": unexplained(records)}
  if args.replan:
    results = json.loads(args.replan.read_text())
    results["rows"] = [replan(r) if not args.rows or r["row"] in args.rows else r
                       for r in results["rows"]]
    results["unexplained"] = unexplained(results["rows"])
    common.write(results, args.out)
    args.out.with_suffix(".md").write_text(markdown(results["rows"]))
    print(markdown(results["rows"]), end="")
    return results
  results = {**common.header("aot_table", device=False), **common.versions(),
             "tolerance": TOLERANCE, "rows": []}
  for row in select(args.rows):  # Written after each row: the large ones take minutes.
    results["rows"].append(measure(row))
    results["unexplained"] = unexplained(results["rows"])
    common.write(results, args.out)
    args.out.with_suffix(".md").write_text(markdown(results["rows"]))
  print(markdown(results["rows"]))
  if results.get("unexplained"):
    print(f"more than {TOLERANCE:.0%} from XLA, not explained: "
          f"{', '.join(results['unexplained'])}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
