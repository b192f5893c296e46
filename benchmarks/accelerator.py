"""The accelerator checks of issue #23 in one command, on whatever backend JAX has.

For one Llama size (the 0.76B model of issue #23 on a GPU or TPU, a small one
on a CPU) it reports, in one JSON record and one Markdown table:

  kernels      what `jax-ai-stack kernels` says for the training request: the
               chosen attention implementation, the fallback chain, whether
               the whole step is deterministic
  attention    forward+backward of each eligible kernel against torch's SDPA
               on the same device (`attention.py`; torch where importable)
  model step   the recipe's bare step (`recipes.step.make_steps`), the
               Trainer's steady per-step time through the real `jax-ai-stack
               train` loop, torch.compile and eager on the same device
               (`torch_process.py`), MFU against the datasheet peak and against
               a matmul measured here, time to the first step cold (empty
               compilation cache) and cached (a second process, same cache)
  determinism  two identical runs compared bitwise (per-step loss and gradient
               norm, then the whole restored state), and the throughput of
               `train.deterministic=true` against `false`
  resume       a run sent SIGTERM after a few steps, then resumed, compared
               bitwise with the run that never stopped

Targets (stored in the record under "targets"): recipe step / torch.compile
<= 0.9, MFU >= 0.55 of the datasheet peak (where known), Trainer / bare step
<= 1.05, deterministic / non-deterministic throughput >= 0.9, and every
bitwise check true.

The training runs are `jax-ai-stack train` in child processes (this file with
`--child`, which times the Trainer's own metric fetches), started before this
process allocates device memory. This process then runs with
`XLA_PYTHON_CLIENT_PREALLOCATE=false` (so PyTorch fits beside it) and XLA's
deterministic GPU ops (the Trainer's default), and times the rest.

    python benchmarks/accelerator.py                  # 0.76b on an accelerator, tiny on CPU
    python benchmarks/accelerator.py --size medium
    python benchmarks/accelerator.py --quick          # a smoke test (~45 s on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import common

# This file is also the training child (`--child`): jax and the benchmarks that
# import it are imported inside functions, so that a child starts as the CLI does.

DATASHEET_TFLOPS = {  # Dense bfloat16 peak by substring of jax's device_kind.
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H200": 989.0,
    "A100": 312.0,
}
"""Vendor datasheet peaks (TFLOP/s, bf16, dense); other devices (and CPUs): unknown."""

TARGETS = {  # name: (limit, at_least)
    "recipe step / torch.compile step": (0.9, False),
    "MFU / datasheet peak": (0.55, True),
    "Trainer step / bare step": (1.05, False),
    "deterministic / non-deterministic throughput": (0.9, True),
}


@dataclasses.dataclass(frozen=True)
class Plan:
  """How much of each check a size runs."""

  size: str
  """A `train_step.SIZES` name, or "0.76b"."""
  train_steps: int
  """Steps of each training run (the Trainer's timing, the bitwise checks)."""
  log_every: int
  """`train.log_every`: the Trainer fetches (and this times) every this many steps."""
  sigterm_after: int
  """The interrupted run sends itself SIGTERM once this step's metrics are fetched."""
  max_documents: int
  """`data.max_documents`: enough text for the steps."""


PLANS = {
    "quick": Plan("quick", train_steps=40, log_every=5, sigterm_after=10, max_documents=30),
    "tiny": Plan("tiny", train_steps=40, log_every=5, sigterm_after=15, max_documents=400),
    "medium": Plan("medium", train_steps=20, log_every=4, sigterm_after=8, max_documents=400),
    "0.76b": Plan("0.76b", train_steps=40, log_every=5, sigterm_after=15, max_documents=400),
}


def sizes() -> dict[str, Any]:
  """train_step's sizes plus the 0.76B Llama of issue #23 (bfloat16, seq 2048, batch 8)."""
  import train_step  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes.models.decoder import DecoderConfig  # pylint: disable=g-import-not-at-top

  large = DecoderConfig(num_layers=16, d_model=2048, num_heads=16, num_kv_heads=8, mlp_dim=5632,
                      max_seq_len=2048, dtype="bfloat16")
  return {**train_step.SIZES, "0.76b": train_step.Size(large, seq_len=2048, batch_size=8, rounds=4)}


def datasheet_peak(device_kind: str) -> float | None:
  """The bf16 datasheet peak (TFLOP/s) of a device kind, or None when unknown."""
  return next((tflops for key, tflops in DATASHEET_TFLOPS.items() if key in device_kind), None)


def without_deterministic_flag(environ: dict[str, str]) -> dict[str, str]:
  """`environ` without XLA's deterministic-ops flag: the children's CLI sets it per run."""
  flags = [f for f in environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_gpu_deterministic_ops")]
  return {**environ, "XLA_FLAGS": " ".join(flags)}


# ---- the training child: `jax-ai-stack train`, its fetches timed ---------------


def train_overrides(size, plan: Plan) -> list[str]:
  """The `jax-ai-stack train` arguments that train `size` as the benchmark does."""
  model = size.model
  fields = ("num_layers", "d_model", "num_heads", "num_kv_heads", "mlp_dim", "max_seq_len", "dtype")
  return ["lm-tiny", *(f"model.{f}={getattr(model, f)}" for f in fields),
          f"data.seq_len={size.seq_len}", f"data.batch_size={size.batch_size}",
          f"data.max_documents={plan.max_documents}", f"train.steps={plan.train_steps}",
          f"train.log_every={plan.log_every}", "train.eval_every=0", "train.sample_tokens=0",
          "train.progress=false", f"checkpoint.save_every={plan.train_steps + 1}",
          "checkpoint.keep_last=1"]


def state_digest(workdir: pathlib.Path) -> str:
  """sha256 of the newest checkpoint's whole state (parameters, optimizer, step), restored."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import train  # pylint: disable=g-import-not-at-top

  trainer = train.Trainer.open_finished(workdir)
  try:
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.state)[0]:
      array = np.asarray(jax.device_get(leaf))
      digest.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}".encode())
      digest.update(array.tobytes())
    return digest.hexdigest()
  finally:
    trainer.close()


def child(spec_path: pathlib.Path) -> int:
  """Runs `jax-ai-stack train` as the spec says, timing each of the Trainer's fetches.

  The Trainer fetches the metrics of the steps since the last fetch in one
  transfer, which waits for them: the time between two fetches is what those
  steps took in the real loop. Writes {"exit_code", "fetches": [[step, time]],
  "digest"} to the spec's "result" path.
  """
  spec = json.loads(spec_path.read_text())
  from jax_ai_stack import cli  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import train  # pylint: disable=g-import-not-at-top

  fetches = []
  original = train.Trainer.fetch

  def fetch(self, pending, *args, **kwargs):
    records = original(self, pending, *args, **kwargs)
    fetches.append([pending[-1][0], time.time()])
    if spec["sigterm_after"] and pending[-1][0] >= spec["sigterm_after"]:
      spec["sigterm_after"] = None  # Once: as a scheduler's notice would arrive.
      os.kill(os.getpid(), signal.SIGTERM)
    return records

  train.Trainer.fetch = fetch
  code = cli.main(["train", *spec["overrides"], "--workdir", spec["workdir"], "--verbose"])
  digest = state_digest(pathlib.Path(spec["workdir"])) if code == 0 else None
  pathlib.Path(spec["result"]).write_text(json.dumps(
      {"exit_code": code, "fetches": fetches, "digest": digest}))
  return 0


def train_run(name: str, overrides: Sequence[str], directory: pathlib.Path,
              environ: dict[str, str], *, workdir: pathlib.Path | None = None,
              sigterm_after: int | None = None) -> dict[str, Any]:
  """One training child; its timings, per-step losses, state digest and start-up line."""
  import startup  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes.metrics import read_metrics  # pylint: disable=g-import-not-at-top

  workdir = workdir or directory / name
  spec = {"overrides": list(overrides), "workdir": str(workdir), "sigterm_after": sigterm_after,
          "result": str(directory / f"{name}.result.json")}
  spec_path = directory / f"{name}.spec.json"
  spec_path.write_text(json.dumps(spec))
  started = time.time()
  done = subprocess.run([sys.executable, __file__, "--child", str(spec_path)], env=environ,
                        capture_output=True, text=True, errors="replace")
  result_path = pathlib.Path(spec["result"])
  if done.returncode != 0 or not result_path.exists():
    raise RuntimeError(f"training run {name!r} failed (exit {done.returncode}):\n"
                       f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
  result = json.loads(result_path.read_text())
  fetches = result.pop("fetches")
  steps = [r for r in read_metrics(workdir) if r["split"] == "train"]
  try:
    figures = startup.parse_startup(done.stdout)  # `--verbose`'s start-up line.
  except ValueError:  # Its format changed: the figures are left out, not the run.
    figures = {}
  first_step_s = fetches[0][1] - started if fetches else None  # Process start to step 1.
  progress(f"runs: {name}: {time.time() - started:.0f} s, first step at {first_step_s or 0:.1f} s, "
           f"steady {(steady_step_seconds(fetches) or 0) * 1e3:.1f} ms/step, "
           f"compile {figures.get('compile_s')} s")
  return {
      **result,
      "first_step_s": first_step_s,
      "compile_s": figures.get("compile_s"), "programs": figures.get("programs"),
      "cache_hits": figures.get("cache_hits"),
      "steady_step_s": steady_step_seconds(fetches),
      "losses": [[r["step"], r["loss"], r["grad_norm"]] for r in steps],
      "stdout_tail": done.stdout[-1500:],
  }


def steady_step_seconds(fetches: Sequence[Sequence[float]]) -> float | None:
  """Median seconds per step over the windows between fetches, past the first two.

  The first fetch ends the first step (and its compile); the window after it
  holds the first checkpoint's copy to host (Orbax saves step 1).
  """
  windows = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(fetches[1:], fetches[2:])
             if s1 > s0]
  return statistics.median(windows) if windows else None


def training_runs(size, plan: Plan, environ: dict[str, str]) -> dict[str, Any]:
  """Sections "startup", "determinism" and "resume": five training children.

  cold (empty compilation cache), cached (the same command, the same cache):
  time to the first step, and two identical runs; nondeterministic
  (`train.deterministic=false`): its throughput; interrupted (SIGTERM after
  `plan.sigterm_after` steps) then resumed: bitwise the run that never stopped.
  """
  overrides = train_overrides(size, plan)
  with tempfile.TemporaryDirectory(prefix="jax-ai-stack-accelerator-") as tmp:
    directory = pathlib.Path(tmp)
    env = {k: v for k, v in without_deterministic_flag(environ).items()
           if not k.startswith("JAX_PERSISTENT_CACHE")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(directory / "cache")  # Empty: a cold start.
    runs = {}
    for name, extra in (("cold", []), ("cached", []),
                        ("nondeterministic", ["train.deterministic=false"])):
      runs[name] = train_run(name, [*overrides, *extra], directory, env)
      _remove_checkpoints(directory / name)  # The 0.76B state is ~9 GB a checkpoint.
    interrupted = train_run("interrupted", overrides, directory, env,
                            sigterm_after=plan.sigterm_after)
    stopped_at = interrupted["losses"][-1][0] if interrupted["losses"] else None
    resumed = train_run("resumed", overrides, directory, env, workdir=directory / "interrupted")
  return judge_runs(runs, interrupted, resumed, stopped_at)


def _remove_checkpoints(workdir: pathlib.Path) -> None:
  shutil.rmtree(workdir / "checkpoints", ignore_errors=True)


def judge_runs(runs: dict[str, Any], interrupted: dict[str, Any], resumed: dict[str, Any],
               stopped_at: int | None) -> dict[str, Any]:
  """The sections of the training runs, from their records."""
  cold, cached, nondet = runs["cold"], runs["cached"], runs["nondeterministic"]
  det_s, nondet_s = cold["steady_step_s"], nondet["steady_step_s"]

  def slim(run: dict[str, Any]) -> dict[str, Any]:  # The losses are compared, not stored.
    return {k: v for k, v in run.items() if k != "losses"}

  def same_state(run: dict[str, Any]) -> bool:
    return run["digest"] is not None and run["digest"] == cold["digest"]

  return {
      "startup": {"cold_first_step_s": cold["first_step_s"],
                  "cached_first_step_s": cached["first_step_s"],
                  "cold": slim(cold), "cached": slim(cached)},
      "determinism": {
          "identical_runs_bitwise": cold["losses"] == cached["losses"] and same_state(cached),
          "losses_bitwise": cold["losses"] == cached["losses"],
          "state_bitwise": same_state(cached),
          "steps_compared": len(cold["losses"]),
          "deterministic_step_s": det_s, "nondeterministic_step_s": nondet_s,
          "throughput_ratio": nondet_s / det_s if det_s and nondet_s else None,
          "nondeterministic_run_bitwise": same_state(nondet),
          "nondeterministic": slim(nondet),
      },
      "resume": {
          "interrupted_exit_code": interrupted["exit_code"],
          "stopped_at_step": stopped_at,
          "resumed_bitwise": (interrupted["exit_code"] == 143 and same_state(resumed)
                              and resumed["losses"] == cold["losses"]),
          "losses_bitwise": resumed["losses"] == cold["losses"],
          "state_bitwise": same_state(resumed),
          "interrupted": slim(interrupted), "resumed": slim(resumed),
      },
  }


# ---- this process: kernels, attention, the model step --------------------------


def kernels_section(size, plan: Plan) -> dict[str, Any]:
  """What `jax-ai-stack kernels` reports for the Trainer's attention request."""
  from jax_ai_stack import kernels  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import config as recipe_config  # pylint: disable=g-import-not-at-top
  from jax_ai_stack.recipes import tasks  # pylint: disable=g-import-not-at-top

  config = recipe_config.load("lm-tiny", overrides=train_overrides(size, plan)[1:])
  request = tasks.for_config(config).attention_request()
  choice = kernels.resolve_plan(config.model.attention_impl, origin="model.attention_impl",
                                environ=os.environ).report(request)
  return {"request": request.describe(), "chosen": choice.name,
          "fallbacks": [name for name, _ in choice.fallbacks], "source": choice.source,
          "deterministic": choice.deterministic, "nondeterminism": choice.nondeterminism(),
          "report": choice.report()}


def attention_section(size, quick: bool, with_torch: bool, directory: pathlib.Path) -> dict:
  """attention.py at the model's shape (causal, no segment ids: what torch's SDPA takes)."""
  import attention  # pylint: disable=g-import-not-at-top

  model = size.model
  shape = (f"{size.batch_size},{size.seq_len},{model.num_heads},{model.num_kv_heads},"
           f"{model.resolved_head_dim}")
  argv = ["--shape", shape, "--dtype", model.dtype, "--out", str(directory / "attention.json")]
  argv += ["--iterations", "1", "--rounds", "1"] if quick else []
  argv += [] if with_torch else ["--no-torch"]
  record = attention.main(argv)
  return {k: v for k, v in record.items() if k not in ("benchmark", "python", "jax")}


def torch_process_for(size, batch, platform: str, threads: int | None):
  """(PyTorch process on JAX's device, None), or (None, why there is none)."""
  import train_step  # pylint: disable=g-import-not-at-top

  if not train_step.has_torch():
    return None, "torch is not installed"
  if platform not in ("cpu", "gpu"):
    return None, f"torch does not run on {platform}: no comparison on the same device"
  bf16 = size.model.dtype == "bfloat16"  # torch autocast, parameters float32, as JAX's.
  spec = {**train_step.torch_spec(size, threads), "device": "cuda" if platform == "gpu" else "cpu",
          "variants": {"torch_compile": (True, bf16), "torch_eager": (False, bf16)}}
  try:
    return train_step.start_torch(size, batch, None, spec=spec), None
  except RuntimeError as e:
    return None, f"the PyTorch process did not start: {str(e).splitlines()[-1]}"


def step_section(size, rounds: int, min_chunk_seconds: float, matmul_n: int,
                 with_torch: bool, torch_threads: int | None) -> dict[str, Any]:
  """The bare recipe step and torch (compile, eager), interleaved; MFU both ways."""
  import jax  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  batch = train_step.make_batch(size)
  measured_peak = train_step.measure_matmul_peak(matmul_n, dtype=size.model.dtype)
  process, torch_note = (torch_process_for(size, batch, device.platform, torch_threads)
                         if with_torch else (None, "--no-torch"))
  variants = [train_step.recipe_variant(size, batch)]
  try:
    if process is not None:
      variants += train_step.torch_variants(process, ["torch_compile", "torch_eager"])
    seconds, steps = train_step.time_variants(variants, rounds, min_chunk_seconds)
  finally:
    if process is not None:
      process.close()
  ms = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
  flops = size.model.flops_per_token(size.seq_len) * size.tokens_per_step
  achieved = flops / (ms["recipe"] / 1e3)
  datasheet = datasheet_peak(device.device_kind) if device.platform != "cpu" else None
  bf16 = size.model.dtype == "bfloat16"  # The datasheet's peak is bfloat16's.
  return {
      "model": {"params": size.model.num_params(), "num_layers": size.model.num_layers,
                "d_model": size.model.d_model, "num_heads": size.model.num_heads,
                "num_kv_heads": size.model.num_kv_heads, "mlp_dim": size.model.mlp_dim,
                "dtype": size.model.dtype},
      "seq_len": size.seq_len, "batch_size": size.batch_size,
      "tokens_per_step": size.tokens_per_step, "flops_per_step": flops,
      "rounds": rounds, "steps_per_chunk": steps,
      "recipe_ms": ms["recipe"],
      "torch_compile_ms": ms.get("torch_compile"), "torch_eager_ms": ms.get("torch_eager"),
      "torch": process.info if process is not None else torch_note,
      "ms_per_step_rounds": {name: [t * 1e3 for t in s] for name, s in seconds.items()},
      "achieved_tflops": achieved / 1e12,
      "datasheet_peak_tflops": datasheet,
      "matmul_n": matmul_n, "matmul_peak_tflops": measured_peak / 1e12,
      "mfu_datasheet": achieved / (datasheet * 1e12) if datasheet and bf16 else None,
      "mfu_measured": achieved / measured_peak,
  }


# ---- the record ----------------------------------------------------------------


def judge(record: dict[str, Any]) -> dict[str, Any]:
  """The record's targets: each ratio judged (None: not measured here), each bitwise check."""
  step, det = record.get("model_step", {}), record.get("determinism", {})
  trainer_ms = record.get("trainer_step_ms")
  values = {
      "recipe step / torch.compile step": (step["recipe_ms"] / step["torch_compile_ms"]
                                           if step.get("torch_compile_ms") else None),
      "MFU / datasheet peak": step.get("mfu_datasheet"),
      "Trainer step / bare step": trainer_ms / step["recipe_ms"] if trainer_ms and step else None,
      "deterministic / non-deterministic throughput": det.get("throughput_ratio"),
  }
  targets = {name: (common.target(value, TARGETS[name][0], at_least=TARGETS[name][1])
                    if value is not None else None) for name, value in values.items()}
  if det:
    for name, value in (("two identical runs bitwise", det["identical_runs_bitwise"]),
                        ("SIGTERM + resume bitwise", record["resume"]["resumed_bitwise"])):
      targets[name] = {"value": value, "target": True, "met": value is True}
  return targets


def markdown(record: dict[str, Any]) -> str:
  """The record as a Markdown table (and the attention kernels' own), with its device.

  A section not run (--sections) has no rows; its targets read "not measured here".
  """
  versions = ", ".join(f"{k} {v}" for k, v in [("jax", record["jax"]),
                                                ("jaxlib", record["jaxlib"]),
                                                *record["jax_plugins"].items(),
                                                ("torch", record["torch"] or "not installed")])
  ms = lambda v: f"{v:.1f} ms" if v is not None else "n/a"  # noqa: E731
  ms_of_s = lambda v: ms(v * 1e3 if v is not None else None)  # noqa: E731
  rows = []
  if "kernels" in record:
    kern = record["kernels"]
    rows.append(("kernels", "attention (training request)", f"{kern['chosen']}; fallbacks "
                 f"{', '.join(kern['fallbacks'])}; step deterministic: {kern['deterministic']}",
                 "", ""))
  step = record.get("model_step")
  if step:
    rows += [
        ("model step", "recipe bare step", ms(step["recipe_ms"]), "", ""),
        ("model step", "torch.compile / eager step",
         f"{ms(step['torch_compile_ms'])} / {ms(step['torch_eager_ms'])}"
         + ("" if step["torch_compile_ms"] else f" ({step['torch']})"), "", ""),
        ("model step", "achieved", f"{step['achieved_tflops']:.3g} TFLOP/s", "", ""),
        ("model step", "MFU vs measured matmul peak",
         f"{step['mfu_measured']:.3f} (peak {step['matmul_peak_tflops']:.3g} TFLOP/s)", "", ""),
    ]
  if "determinism" in record:
    det = record["determinism"]
    rows += [
        ("model step", "Trainer step (`jax-ai-stack train`)", ms(record["trainer_step_ms"]),
         "", ""),
        ("startup", "first step, cold / cached cache",
         f"{record['startup']['cold_first_step_s']:.1f} s / "
         f"{record['startup']['cached_first_step_s']:.1f} s", "", ""),
        ("determinism", "deterministic / non-deterministic step",
         f"{ms_of_s(det['deterministic_step_s'])} / {ms_of_s(det['nondeterministic_step_s'])}"
         + (f" ({det['note']})" if det.get("note") else ""), "", ""),
        ("resume", "SIGTERM at step", str(record["resume"]["stopped_at_step"]), "", ""),
    ]
  for name, judged in record["targets"].items():
    if judged is None:
      rows.append(("target", name, "not measured here", "", ""))
    elif isinstance(judged["value"], bool):
      rows.append(("target", name, str(judged["value"]), "true",
                   "met" if judged["met"] else "MISSED"))
    else:
      sign = ">=" if judged.get("at_least") else "<="
      rows.append(("target", name, f"{judged['value']:.3f}", f"{sign} {judged['target']}",
                   common.verdict(judged["value"], judged["target"],
                                  at_least=judged.get("at_least", False))))
  size = sizes()[record["size"]]
  lines = [f"{record['device']}, {versions}; size {record['size']} "
           f"({size.model.num_params() / 1e6:.1f}M parameters, {size.model.dtype}, seq "
           f"{size.seq_len}, batch {size.batch_size}); sections {', '.join(record['sections'])}",
           "", "| section | figure | value | target | verdict |", "|---|---|---|---|---|"]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  if "attention" in record:
    attention, r = record["attention"], record["attention"]["request"]
    shape = (f"B{r['batch']} T{r['q_len']} N{r['num_heads']} K{r['num_kv_heads']} "
             f"H{r['head_dim']} {r['dtype']}")
    lines += ["", f"Attention forward+backward ({shape}, causal; torch SDPA: "
              f"{attention['torch_sdpa']}):", "", "| kernel | ms |", "|---|---|"]
    lines += [f"| {name}{' (what auto runs)' if name == attention['chosen'] else ''} | {t:.2f} |"
              for name, t in attention["times_ms"].items()]
  return "\n".join(lines) + "\n"


SECTIONS = ("runs", "kernels", "step", "attention")
"""In the order run: the training children first, before this process holds device memory.
"runs" (five children) costs the most device time: a short lease runs the others alone."""


def progress(message: str) -> None:
  """One line on stderr as each part ends: a run cut off by a time limit still says how far it got."""
  print(f"[accelerator] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
  """The chosen sections in SECTIONS' order, the record written after each (see the docstring)."""
  environ = dict(os.environ)  # The children's: nothing this process sets below.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # Room for the children, torch.
  from jax_ai_stack import determinism  # pylint: disable=g-import-not-at-top

  determinism.configure(True)  # As the Trainer's default: both steps run the same XLA ops.
  import jax  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top

  platform = jax.devices()[0].platform  # Holds no device memory (no preallocation).
  name = "quick" if args.quick else args.size or ("tiny" if platform == "cpu" else "0.76b")
  size, plan = sizes()[name], PLANS[name]
  seconds = {}  # Wall time of each part, to judge what a run costs.
  record = {**common.header("accelerator"), **common.versions(), "size": name,
            "quick": args.quick, "sections": list(args.sections),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "seconds": seconds}
  matmul_n = 256 if args.quick else (2048 if platform == "cpu" else 8192)
  parts = {
      "kernels": lambda: {"kernels": kernels_section(size, plan)},
      "step": lambda: {"model_step": step_with_optimizations(
          train_step, size, args, matmul_n)},
      "attention": lambda: {"attention": attention_in_tmp(size, args)},
      "runs": lambda: training_runs(size, plan, environ),
  }
  for section in SECTIONS:
    if section not in args.sections:
      continue
    started = time.perf_counter()
    record.update(parts[section]())
    seconds[section] = time.perf_counter() - started
    if section == "runs" and platform != "gpu":
      record["determinism"]["note"] = f"both deterministic on {platform}: XLA's ops are"
    steady = record.get("determinism", {}).get("deterministic_step_s")
    record["trainer_step_ms"] = steady * 1e3 if steady else None
    record["targets"] = judge(record)
    common.write(record, args.out)  # What is done so far survives a time limit.
    progress(f"{section}: {seconds[section]:.0f} s (record so far: {args.out})")
  return record


def step_with_optimizations(train_step, size, args: argparse.Namespace, matmul_n: int) -> dict:
  """step_section as the record wants it: --quick disables XLA's optimizations and rounds."""
  with train_step.most_optimizations_disabled(args.quick):
    return step_section(size, 2 if args.quick else size.rounds, 0.0 if args.quick else 0.25,
                        matmul_n, args.torch, args.torch_threads)


def attention_in_tmp(size, args: argparse.Namespace) -> dict[str, Any]:
  with tempfile.TemporaryDirectory() as tmp:
    return attention_section(size, args.quick, args.torch, pathlib.Path(tmp))


def sections_arg(text: str) -> tuple[str, ...]:
  """--sections: a comma-separated subset of SECTIONS."""
  chosen = tuple(part.strip() for part in text.split(",") if part.strip())
  unknown = [part for part in chosen if part not in SECTIONS]
  if unknown or not chosen:
    raise argparse.ArgumentTypeError(
        f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")
  return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/accelerator.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=sorted(PLANS),
                      help="the Llama to benchmark (default: 0.76b on an accelerator, tiny on CPU)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: the 'quick' size, one round of each timing "
                           "(timings not representative)")
  parser.add_argument("--no-torch", dest="torch", action="store_false",
                      help="leave PyTorch out even where it is installed")
  parser.add_argument("--torch-threads", type=common.positive_int, default=None,
                      help="torch.set_num_threads in the PyTorch process (default: torch's); "
                           "1 keeps its CPU timings steady on a busy machine (README)")
  parser.add_argument("--sections", type=sections_arg, default=SECTIONS,
                      help="comma-separated, of " + ", ".join(SECTIONS) + " (default: all; "
                           "'runs', five training children, costs the most device time)")
  parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
  common.add_out_argument(parser, "accelerator")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | int:
  """Runs every check, prints the table, writes the JSON and the Markdown; returns the record."""
  args = parse_args(argv)
  if args.child:
    return child(args.child)
  record = run(args)
  table = markdown(record)
  print("\n" + table)
  common.write(record, args.out)
  args.out.with_suffix(".md").write_text(table)
  print(f"wrote {args.out.with_suffix('.md')}")
  return record


if __name__ == "__main__":
  outcome = main(sys.argv[1:])
  sys.exit(outcome if isinstance(outcome, int) else 0)
