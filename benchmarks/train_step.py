"""Tokens/s of the recipe's Llama train step against a hand-written JAX step.

The recipe step (`jax_ai_stack.recipes.step.make_steps`) splits the model once
and runs a plain `jax.jit` over the state pytree. This benchmark checks that the
convenience costs nothing: in one process, from the same init and on the same
batch, it times

  recipe        make_steps(...)[0]: split/merge inside jax.jit, state donated
  hand_written  the minimal pure-JAX step an expert writes: value_and_grad over
                a params pytree, tx.update + optax.apply_updates, jax.jit, donated
  nnx_jit       nnx.jit over (model, optimizer) in graph mode (the default)
  nnx_jit_tree  nnx.jit(..., graph=False), where the installed flax has it

and reports ms/step, tokens/s, the recipe/hand-written ratio (target <= 1.03),
an MFU estimate against a matmul peak measured on this device in the same run,
and whether every variant ends with bitwise the same parameters.

Timings interleave the variants (one chunk of steps each, round after round,
taking turns to go first) so that noise from other processes on a shared
machine hits them alike; each figure is the median over rounds. A chunk is as
many steps as fill `--min-chunk-seconds` (1 for a CPU, many for a small model on
a GPU, where steps are dispatch-bound and must be timed in flight).

    python benchmarks/train_step.py                # tiny and medium
    python benchmarks/train_step.py --sizes tiny   # skip medium (slow on CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import PositiveInt

from jax_ai_stack.absl_flags import ensure_absl_flags_parsed
from jax_ai_stack.recipes import optim, step
from jax_ai_stack.recipes.tasks import lm_loss
from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.models.llama import Llama, LlamaConfig

RESULTS_PATH = pathlib.Path(__file__).parent / "results" / "train_step.json"
TARGET_RATIO = 1.03
"""The recipe step may take at most 3% longer than the hand-written one."""
OPTIM_CONFIG = optim.OptimConfig()  # adamw, clipping, cosine schedule, masked decay.
TOTAL_STEPS = 1_000  # For the schedule only; the benchmark runs far fewer steps.


@config_dataclass
class Size:
  """A model and the batch it trains on."""

  model: LlamaConfig
  """The Llama to train."""
  seq_len: PositiveInt
  """Tokens per row of the batch."""
  batch_size: PositiveInt
  """Rows per batch."""
  rounds: PositiveInt
  """Timed rounds (one chunk of steps per variant each); `--repeats` overrides."""

  @property
  def tokens_per_step(self) -> int:
    return self.seq_len * self.batch_size


SIZES = {
    "tiny": Size(LlamaConfig.tiny(), seq_len=128, batch_size=16, rounds=12),
    "medium": Size(
        LlamaConfig(
            num_layers=8, d_model=512, num_heads=8, num_kv_heads=2, mlp_dim=1536,
            max_seq_len=512,
        ),
        seq_len=512, batch_size=8, rounds=4,  # ~20 s a step on a 2-core CPU.
    ),
    # Smoke tests only (`--quick`): compiles and runs in about a second.
    "quick": Size(
        LlamaConfig.tiny(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
                         max_seq_len=16),
        seq_len=16, batch_size=2, rounds=2,
    ),
}
DEFAULT_SIZES = ("tiny", "medium")


@dataclasses.dataclass
class Variant:
  """One way to run the same train step.

  `run(n)` takes n steps and returns what to block on; `params()` the
  parameters now, as {path: numpy array}.
  """

  name: str
  run: Callable[[int], Any]
  params: Callable[[], dict[str, np.ndarray]]


def has_tree_mode_jit() -> bool:
  """Whether the installed flax's `nnx.jit` takes `graph=` (tree mode)."""
  return "graph" in inspect.signature(nnx.jit).parameters


def make_batch(size: Size) -> dict[str, jax.Array]:
  """Random tokens; the targets are the inputs shifted by one."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, size.model.vocab_size, (size.batch_size, size.seq_len + 1), np.int32)
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@functools.cache
def _init_fn(config: LlamaConfig) -> Callable[[], Llama]:
  """A compiled `Llama(config, rngs=nnx.Rngs(0))`, one per config.

  Every variant calls it, so all start from the same bits; and the model's
  dozens of initializer ops compile once instead of op by op (seconds each on
  a small CPU).
  """
  return nnx.jit(lambda: Llama(config, rngs=nnx.Rngs(0)))


def _fresh(size: Size) -> tuple[Llama, optax.GradientTransformation]:
  """A new model from the shared init, and the optimizer every variant uses."""
  return _init_fn(size.model)(), optim.build(OPTIM_CONFIG, TOTAL_STEPS)


def _flat(state: Any) -> dict[str, np.ndarray]:
  """{'a/b/c': array} of the parameter leaves of a State (or pure dict)."""
  pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
  leaves = jax.tree_util.tree_leaves_with_path(pure)
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in leaves}


def recipe_variant(size: Size, batch: dict[str, jax.Array]) -> Variant:
  model, tx = _fresh(size)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train_step, _, state = step.make_steps(model, optimizer, lm_loss)
  box = {"state": state}

  def run(n: int):
    for _ in range(n):
      box["state"], metrics = train_step(box["state"], batch)
    return box["state"], metrics

  def params():
    step.merge(model, optimizer, box["state"])
    return _flat(nnx.state(model, nnx.Param))

  return Variant("recipe", run, params)


def hand_written_variant(size: Size, batch: dict[str, jax.Array]) -> Variant:
  model, tx = _fresh(size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.as_pure(params)

  def loss(params, batch):
    return lm_loss(nnx.merge(graphdef, params, rest), batch)[0]

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  box = {"params": params, "opt_state": tx.init(params)}

  def run(n: int):
    for _ in range(n):
      box["params"], box["opt_state"], value = train_step(box["params"], box["opt_state"], batch)
    return box["params"], box["opt_state"], value

  return Variant("hand_written", run, lambda: _flat(box["params"]))


def nnx_jit_variant(size: Size, batch: dict[str, jax.Array], *, graph: bool) -> Variant:
  """`nnx.jit` over the live objects; graph=False is flax's tree mode."""
  model, tx = _fresh(size)
  mode = {} if graph else {"graph": False}  # Graph mode is the default.
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param, **mode)

  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, batch)[0], **mode)(model)
    optimizer.update(model, grads)
    return loss

  jitted = nnx.jit(train_step, donate_argnums=(0, 1), **mode)

  def run(n: int):
    for _ in range(n):
      loss = jitted(model, optimizer, batch)
    # One graph walk per chunk, not per step: the caller blocks on all of it.
    return nnx.state((model, optimizer)), loss

  name = "nnx_jit" if graph else "nnx_jit_tree"
  return Variant(name, run, lambda: _flat(nnx.state(model, nnx.Param)))


def build_variants(size: Size, batch: dict[str, jax.Array]) -> list[Variant]:
  variants = [
      recipe_variant(size, batch),
      hand_written_variant(size, batch),
      nnx_jit_variant(size, batch, graph=True),
  ]
  if has_tree_mode_jit():
    variants.append(nnx_jit_variant(size, batch, graph=False))
  return variants


def measure_matmul_peak(n: int, repeats: int = 5) -> float:
  """FLOP/s of an [n, n] @ [n, n] float32 jnp.dot on the default device.

  The reachable peak for this device and precision, measured rather than
  looked up, so that MFU means the same thing on a laptop CPU and on a GPU.
  """
  a = jnp.ones((n, n), jnp.float32)  # Dense matmul speed does not depend on the values.
  b = jnp.ones((n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    dot(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / statistics.median(times)


def compare_params(variants: Sequence[Variant]) -> dict[str, Any]:
  """Bitwise equality of every variant's parameters with the recipe's."""
  reference = variants[0].params()
  result = {}
  for variant in variants[1:]:
    other = variant.params()
    same_keys = reference.keys() == other.keys()
    max_diff = max(
        (float(np.max(np.abs(reference[k] - other[k]))) for k in reference if k in other),
        default=float("nan"),
    )
    identical = same_keys and all(
        reference[k].dtype == other[k].dtype and np.array_equal(reference[k], other[k])
        for k in reference
    )
    result[variant.name] = {"bitwise_identical": identical, "max_abs_diff": max_diff}
  return result


def _seconds(variant: Variant, steps: int) -> float:
  start = time.perf_counter()
  jax.block_until_ready(variant.run(steps))
  return time.perf_counter() - start


def bench_size(
    size: Size, rounds: int, peak_flops: float, min_chunk_seconds: float
) -> dict[str, Any]:
  """Times every variant of one size; see the module docstring."""
  batch = make_batch(size)
  variants = build_variants(size, batch)
  for variant in variants:
    _seconds(variant, 1)  # Compiles.
  fastest_step = min(_seconds(variant, 1) for variant in variants)
  steps = max(1, math.ceil(min_chunk_seconds / fastest_step))
  seconds = {v.name: [] for v in variants}
  for round_index in range(rounds):
    turn = round_index % len(variants)  # Each variant goes first in some round.
    for variant in variants[turn:] + variants[:turn]:
      seconds[variant.name].append(_seconds(variant, steps) / steps)

  flops_per_step = size.model.flops_per_token(size.seq_len) * size.tokens_per_step
  timings = {}
  for variant_name, per_step in seconds.items():
    median = statistics.median(per_step)
    timings[variant_name] = {
        "ms_per_step": median * 1e3,
        "ms_per_step_min": min(per_step) * 1e3,
        "ms_per_step_rounds": [t * 1e3 for t in per_step],
        "tokens_per_s": size.tokens_per_step / median,
        "mfu": flops_per_step / median / peak_flops,
    }
  ratio = timings["recipe"]["ms_per_step"] / timings["hand_written"]["ms_per_step"]
  ratio_min = timings["recipe"]["ms_per_step_min"] / timings["hand_written"]["ms_per_step_min"]
  equality = compare_params(variants)
  return {
      "model": {
          "num_layers": size.model.num_layers, "d_model": size.model.d_model,
          "num_heads": size.model.num_heads, "num_kv_heads": size.model.num_kv_heads,
          "mlp_dim": size.model.mlp_dim, "params": size.model.num_params(),
      },
      "seq_len": size.seq_len,
      "batch_size": size.batch_size,
      "tokens_per_step": size.tokens_per_step,
      "flops_per_step": flops_per_step,
      "steps_per_chunk": steps,
      "rounds": rounds,
      "steps_compared": 2 + rounds * steps,
      "variants": timings,
      "ratio_recipe_vs_hand_written": ratio,
      "ratio_recipe_vs_hand_written_min": ratio_min,
      "met_target": ratio <= TARGET_RATIO,
      "bitwise_identical": all(e["bitwise_identical"] for e in equality.values()),
      "equality_vs_recipe": equality,
  }


def print_table(results: dict[str, Any]) -> None:
  print(f"\ndevice: {results['device']}  jax {results['jax']}  flax {results['flax']}  "
        f"matmul peak {results['matmul_peak_tflops']:.3f} TFLOP/s (f32, n={results['matmul_n']})")
  header = f"{'size':8} {'variant':14} {'ms/step':>10} {'tokens/s':>12} {'MFU':>7} {'vs hand':>8}"
  print(header)
  print("-" * len(header))
  for size_name, size in results["sizes"].items():
    base = size["variants"]["hand_written"]["ms_per_step"]
    for variant_name, t in size["variants"].items():
      print(f"{size_name:8} {variant_name:14} {t['ms_per_step']:10.2f} {t['tokens_per_s']:12.0f} "
            f"{t['mfu']:7.2%} {t['ms_per_step'] / base:8.3f}")
    verdict = "met" if size["met_target"] else "MISSED"
    print(f"{size_name:8} recipe/hand-written = {size['ratio_recipe_vs_hand_written']:.3f} "
          f"(target <= {TARGET_RATIO}: {verdict}; fastest rounds: "
          f"{size['ratio_recipe_vs_hand_written_min']:.3f}); parameters bitwise identical after "
          f"{size['steps_compared']} steps: {size['bitwise_identical']}")
  if not results["nnx_jit_tree_available"]:
    print("nnx.jit has no graph= argument in this flax: the tree-mode variant was skipped")


def _size_list(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  unknown = [s for s in names if s not in SIZES]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown size {', '.join(unknown) or repr(text)}; choose from {', '.join(SIZES)}"
    )
  return names


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return value


def _non_negative_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value >= 0:
    raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
  return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="benchmarks/train_step.py", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--sizes", type=_size_list, default=list(DEFAULT_SIZES),
                      help=f"comma-separated, from {', '.join(SIZES)} (default: tiny,medium)")
  parser.add_argument("--repeats", type=_positive_int, default=None,
                      help="timed rounds; each variant runs one chunk of steps per round, "
                           "taking turns to go first; the median is reported "
                           "(default: 12 for tiny, 4 for medium)")
  parser.add_argument("--min-chunk-seconds", type=_non_negative_float, default=0.25,
                      help="a timed chunk runs at least this long (default: 0.25), so that a "
                           "dispatch-bound step (small model, GPU) is timed over many steps "
                           "in flight, not one at a time")
  parser.add_argument("--matmul-n", type=_positive_int, default=None,
                      help="side of the square matmul that measures the peak "
                           "(default: 2048 on CPU, 8192 on accelerators)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: the 'quick' size, 2 rounds of 1 step, a small matmul, "
                           "most XLA optimizations off (timings not representative)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS_PATH,
                      help=f"where to write the JSON (default: {RESULTS_PATH})")
  args = parser.parse_args(argv)
  if args.quick:
    args.sizes, args.matmul_n, args.min_chunk_seconds = ["quick"], args.matmul_n or 256, 0.0
  return args


@contextlib.contextmanager
def most_optimizations_disabled(disable: bool):
  """Compiles with most XLA optimizations off, then restores the setting.

  For `--quick` only: on a small shared CPU, XLA's optimizing compile of each
  train step takes seconds, which a smoke test cannot afford; the numbers it
  times are then not representative.
  """
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", disable or before)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  ensure_absl_flags_parsed()  # tokamax (attention kernels) would parse our argv.
  with most_optimizations_disabled(args.quick):
    results = run(args)
  print_table(results)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(results, indent=2) + "\n")
  print(f"wrote {args.out}")
  return results


def run(args: argparse.Namespace) -> dict[str, Any]:
  device = jax.devices()[0]
  matmul_n = args.matmul_n or (2048 if device.platform == "cpu" else 8192)
  peak = measure_matmul_peak(matmul_n)
  results = {
      "benchmark": "train_step",
      "device": f"{device.platform}: {device.device_kind}",
      "python": platform.python_version(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "optimizer": OPTIM_CONFIG.name,
      "matmul_n": matmul_n,
      "matmul_peak_tflops": peak / 1e12,
      "target_ratio": TARGET_RATIO,
      "nnx_jit_tree_available": has_tree_mode_jit(),
      "quick": args.quick,
      "sizes": {
          name: bench_size(SIZES[name], args.repeats or SIZES[name].rounds, peak,
                           args.min_chunk_seconds)
          for name in args.sizes
      },
  }
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
