"""A real model's shapes on one machine: each step of the journey, its time and its peak
memory against the memory plan.

A randomly initialised Qwen3 with Qwen3-0.6B's shapes (596M parameters, bfloat16, in
three safetensors shards) is written by our own exporter (`hf.save`: no download, no
transformers). It then goes where a downloaded one would, each step a `jax-ai-stack`
command in a process of its own, as a user runs them:

  import    import-hf DIR --workdir base
  lora      train finetune.base=base, LoRA rank 8, 3 steps (batch 1 x 256)
  full      train finetune.base=base, every parameter, 2 steps
  generate  generate --workdir lora --prompt ... (32 tokens)
  serve     serve --workdir lora, one completion request over HTTP
  export    export-hf --workdir full

Each step's wall seconds and its process's peak resident memory (`wait4`'s maxrss); the
training steps also the steady s/step and tokens/s (metrics.jsonl, the first step left
out) and the plan `train --dry-run` prints for the same command. On a CPU the devices'
memory is the host's, so the plan is a user's only guide to whether a run fits: the
target (issue 64) is a peak within 1.25x the plan (its total, or its end-of-run sample's
line where larger) plus the runtime allowance the plan states (1.5 GiB).

    python benchmarks/real_size.py            # Qwen3-0.6B's shapes (minutes on 2 cores)
    python benchmarks/real_size.py --quick    # a two-layer model: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import common
from jax_ai_stack.recipes import memory
from jax_ai_stack.recipes.byte_sizes import format_bytes, parse_bytes

PLAN_FACTOR = 1.25
ALLOWANCE = memory.RUNTIME_ALLOWANCE
"""A process's own memory beside the plan's arrays (Python, XLA's runtime, compiled code):
the allowance the plan states on a CPU."""

SHAPES = {  # config.json's fields, as `hf.save` writes them from a DecoderConfig.
    "qwen3-0.6b": dict(kind="qwen3", vocab_size=151_936, num_layers=28, d_model=1024,
                       num_heads=16, num_kv_heads=8, head_dim=128, mlp_dim=3072,
                       max_seq_len=40_960, qk_norm=True, norm_eps=1e-6, rope_theta=1e6,
                       param_dtype="bfloat16", dtype="bfloat16"),
    "quick": dict(kind="qwen3", vocab_size=512, num_layers=2, d_model=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=256, qk_norm=True,
                  param_dtype="bfloat16", dtype="bfloat16"),
}
SHARD_BYTES = {"qwen3-0.6b": parse_bytes("500MB"), "quick": parse_bytes("100KB")}
SEQ_LEN = {"qwen3-0.6b": 256, "quick": 32}
STEPS = {"lora": 3, "full": 2}
NEW_TOKENS = 32


def write_model(directory: pathlib.Path, shape: Mapping[str, Any], shard_bytes: int) -> list[str]:
  """The model's Hugging Face directory, written by `hf.save` from a random init."""
  from flax import nnx

  from jax_ai_stack.recipes.models import hf
  from jax_ai_stack.recipes.models.configs import DecoderConfig
  from jax_ai_stack.recipes.models.decoder import Decoder

  model = Decoder(DecoderConfig(**shape), rngs=nnx.Rngs(0))
  return hf.save(model, directory, max_shard_bytes=shard_bytes)


def write_notes(directory: pathlib.Path, files: int = 8, words: int = 4000) -> None:
  """A folder of plain-text notes to fine-tune on: random sentences of a few hundred words."""
  rng = np.random.default_rng(0)
  vocabulary = np.array(["the", "model", "step", "layer", "token", "memory", "plan", "peak",
                         "train", "sample", "host", "device", "weights", "cache", "rank"])
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(files):
    text = " ".join(rng.choice(vocabulary, size=words))
    (directory / f"{i}.md").write_text(text.replace(" the ", ". The ") + ".\n")


def run_step(argv: Sequence[str], log: pathlib.Path, *, cwd: pathlib.Path) -> dict[str, Any]:
  """`jax-ai-stack ARGV` in its own process: its wall seconds and peak resident bytes.

  Raises:
    SystemExit: the command failed (the end of its output, and the whole log's path).
  """
  start = time.perf_counter()
  with open(log, "w") as out:
    process = subprocess.Popen([sys.executable, "-m", "jax_ai_stack.cli", *argv], cwd=cwd,
                               stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
  process.returncode = os.waitstatus_to_exitcode(status)
  if process.returncode != 0:
    raise SystemExit(f"`jax-ai-stack {' '.join(argv)}` exited {process.returncode}:\n"
                     f"{log.read_text()[-3000:]}\n(the whole output: {log})")
  return {"seconds": time.perf_counter() - start, "peak_bytes": usage.ru_maxrss * 1024}


def serve_one_request(workdir: pathlib.Path, log: pathlib.Path, *, cwd: pathlib.Path
                      ) -> dict[str, Any]:
  """`jax-ai-stack serve`, one completion request once it listens, then SIGTERM: the whole
  process's wall seconds and peak, and the request's own seconds."""
  start = time.perf_counter()
  with open(log, "w") as err:  # The child holds its own copy of the file.
    process = subprocess.Popen([sys.executable, "-m", "jax_ai_stack.cli", "serve", "--workdir",
                                str(workdir), "--port", "0"], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=err, text=True)
  line = process.stdout.readline()
  try:
    match = re.search(r"serving '(.+?)' at (http://\S+?)[;\s]", line)
    if match is None:
      raise SystemExit(f"serve printed no address: {line!r}\n{log.read_text()[-3000:]}")
    request = urllib.request.Request(
        f"{match.group(2)}/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": match.group(1), "max_tokens": NEW_TOKENS, "temperature": 0,
                         "prompt": "The plan"}).encode())
    asked = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
      reply = json.load(response)
    request_s = time.perf_counter() - asked
  finally:
    process.terminate()
    _, _, usage = os.wait4(process.pid, 0)
  return {"seconds": time.perf_counter() - start, "peak_bytes": usage.ru_maxrss * 1024,
          "request_s": request_s, "completion_tokens": reply["usage"]["completion_tokens"]}


def planned_bytes(argv: Sequence[str], *, cwd: pathlib.Path) -> int:
  """The peak of the memory plan `jax-ai-stack ARGV --dry-run` prints: its total, or its
  end-of-run sample's line where that is larger."""
  result = subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", *argv, "--dry-run"],
                          cwd=cwd, capture_output=True, text=True)
  lines = re.findall(r"^\s*(total|sampling)\s+([\d.]+ ?[KMGT]?i?B)\b", result.stdout, re.MULTILINE)
  if result.returncode != 0 or not lines:
    raise SystemExit(f"--dry-run printed no plan:\n{result.stdout}{result.stderr[-3000:]}")
  return max(parse_bytes(value.replace(" ", "")) for _, value in lines)


def steady_speed(workdir: pathlib.Path) -> dict[str, float]:
  """s/step and tokens/s of the run's steps after its first (which compiles)."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "step_time" in r][1:] or [r for r in records if "step_time" in r]
  return {"s_per_step": float(np.mean([r["step_time"] for r in steps])),
          "tokens_per_s": float(np.mean([r["throughput"] for r in steps]))}


def run(args: argparse.Namespace) -> dict[str, Any]:
  name = "quick" if args.quick else "qwen3-0.6b"
  seq_len = SEQ_LEN[name]
  steps = {}
  with tempfile.TemporaryDirectory(prefix="jax-ai-stack-real-size-") as tmp:
    tmp = pathlib.Path(tmp)
    logs = tmp / "logs"
    logs.mkdir()
    start = time.perf_counter()
    files = write_model(tmp / "model", SHAPES[name], SHARD_BYTES[name])
    weights = sum(p.stat().st_size for p in (tmp / "model").glob("*.safetensors"))
    steps["write"] = {"seconds": time.perf_counter() - start, "files": len(files),
                      "weights_bytes": weights}
    write_notes(tmp / "notes")
    print(f"{name}: wrote {len(files)} files in {steps['write']['seconds']:.1f} s", flush=True)
    recipe = ["data.source=text", "data.paths=[notes/*.md]", f"data.seq_len={seq_len}",
              "data.batch_size=1", "data.validation_fraction=0.05", "train.eval_every=0",
              f"train.sample_tokens={NEW_TOKENS}", f"model.max_seq_len={2 * seq_len}"]
    steps["import"] = run_step(["import-hf", "model", "--workdir", "base", *recipe],
                               logs / "import.log", cwd=tmp)
    steps["import"]["peak_over_weights"] = steps["import"]["peak_bytes"] / weights
    _say("import", steps["import"])
    for kind, extra in (("lora", ["finetune.lora.rank=8"]), ("full", [])):
      argv = ["train", "--config", "base/config.yaml", "--workdir", kind, "finetune.base=base",
              f"train.steps={STEPS[kind]}", *extra]
      plan = planned_bytes(argv, cwd=tmp)
      steps[kind] = {**run_step(argv, logs / f"{kind}.log", cwd=tmp), "plan_bytes": plan,
                     **steady_speed(tmp / kind)}
      steps[kind]["peak_over_plan"] = steps[kind]["peak_bytes"] / plan
      target = PLAN_FACTOR * plan + ALLOWANCE
      steps[kind]["target"] = common.target(steps[kind]["peak_bytes"] / target, 1.0)
      _say(kind, steps[kind])
    steps["generate"] = run_step(["generate", "--workdir", "lora", "--prompt", "The plan",
                                  "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"],
                                 logs / "generate.log", cwd=tmp)
    summary = re.search(r"([\d.]+) tokens/s, first token after ([\d.]+) s",
                        (logs / "generate.log").read_text())
    if summary:
      steps["generate"].update(tokens_per_s=float(summary.group(1)),
                               first_token_s=float(summary.group(2)))
    _say("generate", steps["generate"])
    steps["serve"] = serve_one_request(tmp / "lora", logs / "serve.log", cwd=tmp)
    _say("serve", steps["serve"])
    steps["export"] = run_step(["export-hf", "--workdir", "full", "exported"],
                               logs / "export.log", cwd=tmp)
    _say("export", steps["export"])
  return {**common.header("real_size", device=False), "shapes": name, "model": SHAPES[name],
          "seq_len": seq_len, "batch_size": 1, "plan_factor": PLAN_FACTOR,
          "allowance_bytes": ALLOWANCE, "steps": steps,
          "met_target": all(steps[k]["target"]["met"] for k in STEPS)}


def _say(name: str, figures: Mapping[str, Any]) -> None:
  print(f"{name}: {figures['seconds']:.1f} s, peak {format_bytes(figures['peak_bytes'])}",
        flush=True)


def print_table(results: dict[str, Any]) -> None:
  print(f"\n{results['shapes']}, batch 1 x {results['seq_len']} tokens")
  print(f"{'step':9} {'wall':>8} {'peak':>11} {'plan':>11} {'peak/plan':>9} {'s/step':>7} "
        f"{'tokens/s':>9}")
  for name, figures in results["steps"].items():
    if "peak_bytes" not in figures:
      continue
    plan = figures.get("plan_bytes")
    print(f"{name:9} {figures['seconds']:7.1f}s {format_bytes(figures['peak_bytes']):>11} "
          f"{format_bytes(plan) if plan else '':>11} "
          f"{format(figures['peak_over_plan'], '.2f') if plan else '':>9} "
          f"{format(figures['s_per_step'], '.2f') if 's_per_step' in figures else '':>7} "
          f"{format(figures['tokens_per_s'], ',.1f') if 'tokens_per_s' in figures else '':>9}")
  for kind in STEPS:
    figures = results["steps"][kind]
    print(f"{kind}: peak <= {PLAN_FACTOR} x plan + {format_bytes(ALLOWANCE)}: "
          f"{common.verdict(figures['target']['value'], 1.0)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/real_size.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a two-layer model, a 32-token batch")
  common.add_out_argument(parser, "real_size")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  results = run(args)
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
