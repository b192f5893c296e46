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

With `--bf16` it also times `recipe_bf16`: the recipe with `model.dtype=
bfloat16` (parameters float32). With `--torch` (needs PyTorch: `pip install
jax-ai-stack[bench]`) it adds `recipe_bf16` and the same step in PyTorch
(`torch_llama.py`, from the same initial parameters: the first losses must
agree): eager and `torch.compile`, float32 and bfloat16 autocast, with the
ratio recipe / torch.compile; and a per-component table (attention core,
projections, MLP, head + loss, optimizer, everything else) of the recipe and
of torch.compile, so that the next gap is visible. PyTorch runs in a child
process (`torch_process.py`), driven round by round from this one, so that
the two runtimes' thread pools never share a process (in one process its step
measured 10-37% slower on a quiet 2-core CPU); `--torch-threads` sets its
thread count (see benchmarks/README.md on a busy machine).

Timings interleave the variants (one chunk of steps each, round after round,
taking turns to go first) so that noise from other processes on a shared
machine hits them alike; each figure is the median over rounds. A chunk is as
many steps as fill `--min-chunk-seconds` (1 for a CPU, many for a small model on
a GPU, where steps are dispatch-bound and must be timed in flight).

    python benchmarks/train_step.py                # tiny and medium
    python benchmarks/train_step.py --sizes tiny   # skip medium (slow on CPU)
    python benchmarks/train_step.py --sizes tiny --torch   # against PyTorch
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import math
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

import common
import torch_process
from jax_ai_stack.recipes import optim, step
from jax_ai_stack.recipes.tasks import lm_loss
from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

TARGET_RATIO = 1.03
"""The recipe step may take at most 3% longer than the hand-written one."""
EVERYTHING_ELSE_SHARE = 0.15
"""Target share of the step outside the timed parts (norms, RoPE, residuals, copies)."""
PARTS_TOLERANCE = 0.15
"""A parts column whose parts sum further than this from its step is flagged as not credible."""
OPTIM_CONFIG = optim.OptimConfig()  # adamw, clipping, cosine schedule, masked decay.
TOTAL_STEPS = 1_000  # For the schedule only; the benchmark runs far fewer steps.


@config_dataclass
class Size:
  """A model and the batch it trains on."""

  model: DecoderConfig
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
    "tiny": Size(DecoderConfig.tiny(), seq_len=128, batch_size=16, rounds=12),
    "medium": Size(
        DecoderConfig(
            num_layers=8, d_model=512, num_heads=8, num_kv_heads=2, mlp_dim=1536,
            max_seq_len=512,
        ),
        seq_len=512, batch_size=8, rounds=4,  # ~20 s a step on a 2-core CPU.
    ),
    # Smoke tests only (`--quick`): compiles and runs in about a second.
    "quick": Size(
        DecoderConfig.tiny(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
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
  run: Callable[[int], Any] | None
  params: Callable[[], dict[str, np.ndarray]] | None
  """None: not expected to match the recipe's bits (bfloat16, PyTorch)."""
  seconds: Callable[[int], float] | None = None
  """Instead of `run`: takes n steps and returns their time as measured where
  they ran (PyTorch, in its own process)."""


def has_tree_mode_jit() -> bool:
  """Whether the installed flax's `nnx.jit` takes `graph=` (tree mode)."""
  return "graph" in inspect.signature(nnx.jit).parameters


def make_batch(size: Size) -> dict[str, jax.Array]:
  """Random tokens; the targets are the inputs shifted by one."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, size.model.vocab_size, (size.batch_size, size.seq_len + 1), np.int32)
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@functools.cache
def _init_fn(config: DecoderConfig) -> Callable[[], Decoder]:
  """A compiled `Decoder(config, rngs=nnx.Rngs(0))`, one per config.

  Every variant calls it, so all start from the same bits; and the model's
  dozens of initializer ops compile once instead of op by op (seconds each on
  a small CPU).
  """
  return nnx.jit(lambda: Decoder(config, rngs=nnx.Rngs(0)))


def _fresh(size: Size) -> tuple[Decoder, optax.GradientTransformation]:
  """A new model from the shared init, and the optimizer every variant uses."""
  return _init_fn(size.model)(), optim.build(OPTIM_CONFIG, TOTAL_STEPS)


def _flat(state: Any) -> dict[str, np.ndarray]:
  """{'a/b/c': array} of the parameter leaves of a State (or pure dict)."""
  pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
  leaves = jax.tree_util.tree_leaves_with_path(pure)
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in leaves}


def recipe_variant(size: Size, batch: dict[str, jax.Array], name: str = "recipe") -> Variant:
  """The recipe's step; a `size` of another dtype is another variant (`name`)."""
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

  return Variant(name, run, params if name == "recipe" else None)


def bf16_size(size: Size) -> Size:
  """`size` with bfloat16 compute (`model.dtype`), parameters still float32."""
  return dataclasses.replace(size, model=dataclasses.replace(size.model, dtype="bfloat16"))


def has_torch() -> bool:
  """Whether PyTorch is installed (this process never imports it)."""
  return importlib.util.find_spec("torch") is not None


TORCH_VARIANTS = {  # name: (torch.compile, bfloat16 autocast)
    "torch_eager": (False, False),
    "torch_compile": (True, False),
    "torch_eager_bf16": (False, True),
    "torch_compile_bf16": (True, True),
}


def torch_spec(size: Size, threads: int | None = None) -> dict[str, Any]:
  """What the PyTorch process builds (see torch_process.py), as plain JSON."""
  return {
      "threads": threads,  # None: torch's default (one per core).
      "model": {**dataclasses.asdict(size.model), "resolved_head_dim": size.model.resolved_head_dim,
                "padded_vocab_size": size.model.padded_vocab_size},
      "optim": dataclasses.asdict(OPTIM_CONFIG),
      "total_steps": TOTAL_STEPS,
      "variants": TORCH_VARIANTS,
  }


def start_torch(size: Size, batch: dict[str, jax.Array], threads: int | None, *,
                spec: dict[str, Any] | None = None) -> torch_process.TorchProcess:
  """The PyTorch process, its trainers built from the recipe's initial parameters.

  `spec`: what it builds (default `torch_spec(size, threads)`).
  """
  params = _flat(nnx.state(_init_fn(size.model)(), nnx.Param))
  return torch_process.TorchProcess(spec or torch_spec(size, threads), params, batch)


def torch_variants(process: torch_process.TorchProcess,
                   names: Sequence[str] = tuple(TORCH_VARIANTS)) -> list[Variant]:
  """The PyTorch variants `names` (built in `process`), each step timed in its process."""
  def seconds(name: str, steps: int) -> float:
    return process.call(op="run", variant=name, steps=steps)["seconds"]

  return [Variant(name, None, None, functools.partial(seconds, name)) for name in names]


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


def build_variants(size: Size, batch: dict[str, jax.Array], *, bf16: bool = False) -> list[Variant]:
  variants = [
      recipe_variant(size, batch),
      hand_written_variant(size, batch),
      nnx_jit_variant(size, batch, graph=True),
  ]
  if has_tree_mode_jit():
    variants.append(nnx_jit_variant(size, batch, graph=False))
  if bf16:
    variants.append(recipe_variant(bf16_size(size), batch, name="recipe_bf16"))
  return variants


def _grad_thunk(fn: Callable, *args) -> Callable[[], Any]:
  """A jitted forward + backward of scalar `fn(*args)` with respect to every arg."""
  grad = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args)))))
  return lambda: grad(*args)


def jax_components(size: Size, batch: dict[str, jax.Array]) -> dict[str, Callable[[], Any]]:
  """Thunks that run one part of the recipe's step (forward + backward) on its own.

  Per block: the attention kernel on q, k, v; the q, k, v, o projections; the
  SwiGLU MLP. Once: the head (tied embedding) + cross-entropy, and the optimizer
  update (clipping + AdamW) over every parameter. Each is its own jitted
  program, so fusions across the boundaries are lost: "everything else" (the
  step minus the parts) can come out negative when the whole step fuses better.
  """
  c = size.model
  model, tx = _fresh(size)
  rng = np.random.default_rng(2)
  dtype = jnp.dtype(c.dtype)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  b, t, n, k, h = size.batch_size, size.seq_len, c.num_heads, c.num_kv_heads, c.resolved_head_dim
  x, q, kk, v = normal(b, t, c.d_model), normal(b, t, n, h), normal(b, t, k, h), normal(b, t, k, h)
  block = model.layers[0]
  plan = block.attention.attention_plan

  def on(module, fn):
    """fn(module, *args) as a function of the module's state and args."""
    graphdef, state = nnx.split(module)
    return lambda state, *args: fn(nnx.merge(graphdef, state), *args), nnx.state(module)

  def projections(a, x):
    qx = a.q_proj(x)
    return (qx.sum() + a.k_proj(x).sum() + a.v_proj(x).sum() + a.o_proj(qx).sum()).astype(jnp.float32)

  def head_loss(embed, x):
    logits = embed.attend(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  attention = lambda q, k, v: kernels_attention(q, k, v, plan).astype(jnp.float32).sum()  # noqa: E731
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  opt_state = tx.init(params)

  @jax.jit
  def optimizer(params, opt_state):
    updates, opt_state = tx.update(params, opt_state, params)  # The params stand in for grads.
    return optax.apply_updates(params, updates), opt_state

  thunks = {
      "attention core": _grad_thunk(attention, q, kk, v),
      "projections": _grad_thunk(*on(block.attention, projections), x),
      "MLP": _grad_thunk(*on(block.mlp, lambda m, x: m(x).astype(jnp.float32).sum()), x),
      "head + loss": _grad_thunk(*on(model.embed, head_loss), x),
      "optimizer": lambda: optimizer(params, opt_state),
  }
  for thunk in thunks.values():
    for _ in range(torch_process.WARMUP_CALLS):  # Compiles, settles: as the PyTorch side.
      jax.block_until_ready(thunk())
  return {part: functools.partial(_block_seconds, thunk) for part, thunk in thunks.items()}


def _block_seconds(thunk: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(thunk())
  return time.perf_counter() - start


def torch_components(process: torch_process.TorchProcess, variant: str) -> dict[str, Callable[[], float]]:
  """The same parts in PyTorch (`torch_llama.components`), timed in its process."""
  def seconds(part: str) -> float:
    return process.call(op="part", variant=variant, part=part)["seconds"]

  parts = process.call(op="parts", variant=variant)["parts"]
  return {part: functools.partial(seconds, part) for part in parts}


def kernels_attention(q, k, v, plan):
  from jax_ai_stack import kernels

  return kernels.attention(q, k, v, causal=True, plan=plan)


PER_LAYER = ("attention core", "projections", "MLP")


def time_components(timers: dict[str, dict[str, Callable[[], float]]], step_ms: dict[str, float],
                    num_layers: int, rounds: int) -> dict[str, dict[str, float]]:
  """ms per step of each part ({framework: {part: timer}}), interleaved; "everything else".

  A timer runs its part once (compiled already) and returns the seconds it took.
  """
  seconds = {fw: {part: [] for part in parts} for fw, parts in timers.items()}
  for _ in range(rounds):
    for fw, parts in timers.items():
      for part, timer in parts.items():
        time.sleep(SETTLE_SECONDS)
        seconds[fw][part].append(timer())
  table = {}
  for fw, parts in seconds.items():
    row = {part: statistics.median(s) * 1e3 * (num_layers if part in PER_LAYER else 1)
           for part, s in parts.items()}
    row["everything else"] = step_ms[fw] - sum(row.values())
    row["step"] = step_ms[fw]
    table[fw] = row
  return table


def parts_off_by(row: dict[str, float]) -> float:
  """How far a framework's timed parts sum from its step, as a share of the step.

  Over `PARTS_TOLERANCE` the parts, each its own program timed alone, do not
  say where the step's time goes (fusion across parts, other kernels, a
  compiler that treats a lone part differently): the table says so.
  """
  parts = sum(v for k, v in row.items() if k not in ("everything else", "step"))
  return abs(parts - row["step"]) / row["step"]


def measure_matmul_peak(n: int, repeats: int = 5, dtype: Any = jnp.float32) -> float:
  """FLOP/s of an [n, n] @ [n, n] jnp.dot (float32 unless `dtype`) on the default device.

  The reachable peak for this device and precision, measured rather than
  looked up, so that MFU means the same thing on a laptop CPU and on a GPU.
  """
  a = jnp.ones((n, n), dtype)  # Dense matmul speed does not depend on the values.
  b = jnp.ones((n, n), dtype)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    dot(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / statistics.median(times)


def compare_params(variants: Sequence[Variant]) -> dict[str, Any]:
  """Bitwise equality of every variant's parameters with the recipe's.

  Variants without `params` (bfloat16, PyTorch) are not compared.
  """
  reference = variants[0].params()
  result = {}
  for variant in variants[1:]:
    if variant.params is None:
      continue
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


WARMUP_STEPS = 3
"""Untimed steps per variant first: the first few PyTorch steps (eager or compiled)
ran up to 10x slower than later ones here."""
SETTLE_SECONDS = 0.2
"""Untimed pause before each timed chunk. XLA's and PyTorch's CPU thread pools
spin for a while after their work (in this process or PyTorch's); a chunk right
after the other framework's would share the cores with those spinning threads."""


def _seconds(variant: Variant, steps: int) -> float:
  time.sleep(SETTLE_SECONDS)
  if variant.seconds is not None:
    return variant.seconds(steps)
  start = time.perf_counter()
  jax.block_until_ready(variant.run(steps))
  return time.perf_counter() - start


def time_variants(variants: Sequence[Variant], rounds: int,
                  min_chunk_seconds: float) -> tuple[dict[str, list[float]], int]:
  """({name: seconds per step in each round}, steps per chunk), rounds interleaved.

  Each variant first runs `WARMUP_STEPS` untimed (compiles); a chunk is as many
  steps as fill `min_chunk_seconds` at the fastest variant's speed; in each
  round every variant runs one chunk, taking turns to go first.
  """
  for variant in variants:
    _seconds(variant, WARMUP_STEPS)  # Compiles, and lets PyTorch settle.
  fastest_step = min(_seconds(variant, 1) for variant in variants)
  steps = max(1, math.ceil(min_chunk_seconds / fastest_step))
  seconds = {v.name: [] for v in variants}
  for round_index in range(rounds):
    turn = round_index % len(variants)  # Each variant goes first in some round.
    for variant in variants[turn:] + variants[:turn]:
      seconds[variant.name].append(_seconds(variant, steps) / steps)
  return seconds, steps


def bench_size(
    size: Size, rounds: int, peak_flops: float, min_chunk_seconds: float, *,
    bf16: bool = False, with_torch: bool = False, torch_threads: int | None = None,
) -> dict[str, Any]:
  """Times every variant of one size; see the module docstring."""
  batch = make_batch(size)
  if not with_torch:
    return _bench_size(size, batch, rounds, peak_flops, min_chunk_seconds, bf16=bf16)
  with start_torch(size, batch, torch_threads) as process:
    return _bench_size(size, batch, rounds, peak_flops, min_chunk_seconds, bf16=True,
                       torch=process)


def _bench_size(
    size: Size, batch: dict[str, jax.Array], rounds: int, peak_flops: float,
    min_chunk_seconds: float, *, bf16: bool, torch: torch_process.TorchProcess | None = None,
) -> dict[str, Any]:
  """bench_size's measurements, with the PyTorch variants when `torch` is given."""
  variants = build_variants(size, batch, bf16=bf16)
  if torch is not None:
    variants += torch_variants(torch)
  seconds, steps = time_variants(variants, rounds, min_chunk_seconds)

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
  extra = {}
  if "recipe_bf16" in timings:
    extra["ratio_bf16_vs_f32"] = timings["recipe_bf16"]["ms_per_step"] / timings["recipe"]["ms_per_step"]
    extra["bf16_target"] = common.target(extra["ratio_bf16_vs_f32"], 1.0)
  if torch is not None:
    extra.update(torch_comparison(size, batch, timings, torch, rounds))
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
      "steps_compared": WARMUP_STEPS + 1 + rounds * steps,
      "variants": timings,
      "ratio_recipe_vs_hand_written": ratio,
      "ratio_recipe_vs_hand_written_min": ratio_min,
      "met_target": ratio <= TARGET_RATIO,
      "bitwise_identical": all(e["bitwise_identical"] for e in equality.values()),
      "equality_vs_recipe": equality,
      **extra,
  }


def torch_comparison(size: Size, batch: dict[str, jax.Array], timings: dict[str, Any],
                     process: torch_process.TorchProcess, rounds: int) -> dict[str, Any]:
  """Ratios to PyTorch, the first-loss check, and the per-component table."""
  jax_loss = float(lm_loss(_init_fn(size.model)(), batch)[0])
  torch_loss = process.call(op="first_loss")["loss"]
  recipe_ms = timings["recipe"]["ms_per_step"]
  step_ms = {"recipe": recipe_ms, "torch_compile": timings["torch_compile"]["ms_per_step"]}
  timers = {"recipe": jax_components(size, batch),
            "torch_compile": torch_components(process, "torch_compile")}
  components = time_components(timers, step_ms, size.model.num_layers, rounds)
  ratio = recipe_ms / timings["torch_compile"]["ms_per_step"]
  ratio_bf16 = timings["recipe_bf16"]["ms_per_step"] / timings["torch_compile_bf16"]["ms_per_step"]
  return {
      "torch_process": process.info,  # {"torch": version, "threads": its intra-op threads}
      "first_loss": {"jax": jax_loss, "torch": torch_loss, "abs_diff": abs(jax_loss - torch_loss)},
      "ratio_recipe_vs_torch_compile": ratio,
      "ratio_recipe_vs_torch_eager": recipe_ms / timings["torch_eager"]["ms_per_step"],
      "ratio_recipe_bf16_vs_torch_compile_bf16": ratio_bf16,
      "components_ms": components,
      "components_add_up": {fw: parts_off_by(row) <= PARTS_TOLERANCE
                            for fw, row in components.items()},
      "torch_targets": {
          "recipe / torch.compile": common.target(ratio, 1.0),
          "recipe bf16 / torch.compile bf16": common.target(ratio_bf16, 1.0),
          "everything else / recipe step": common.target(
              components["recipe"]["everything else"] / recipe_ms, EVERYTHING_ELSE_SHARE),
      },
  }


def print_table(results: dict[str, Any]) -> None:
  print(f"\ndevice: {results['device']}  jax {results['jax']}  flax {results['flax']}  "
        f"matmul peak {results['matmul_peak_tflops']:.3f} TFLOP/s (f32, n={results['matmul_n']})")
  header = f"{'size':8} {'variant':18} {'ms/step':>10} {'tokens/s':>12} {'MFU':>7} {'vs hand':>8}"
  print(header)
  print("-" * len(header))
  for size_name, size in results["sizes"].items():
    base = size["variants"]["hand_written"]["ms_per_step"]
    for variant_name, t in size["variants"].items():
      print(f"{size_name:8} {variant_name:18} {t['ms_per_step']:10.2f} {t['tokens_per_s']:12.0f} "
            f"{t['mfu']:7.2%} {t['ms_per_step'] / base:8.3f}")
    verdict = common.verdict(size["ratio_recipe_vs_hand_written"], TARGET_RATIO)
    print(f"{size_name:8} recipe/hand-written = {size['ratio_recipe_vs_hand_written']:.3f} "
          f"(target <= {TARGET_RATIO}: {verdict}; fastest rounds: "
          f"{size['ratio_recipe_vs_hand_written_min']:.3f}); parameters bitwise identical after "
          f"{size['steps_compared']} steps: {size['bitwise_identical']}")
    if "ratio_bf16_vs_f32" in size:
      print(f"{size_name:8} recipe bfloat16 / float32 = {size['ratio_bf16_vs_f32']:.3f} "
            f"(target <= 1: {common.verdict(size['ratio_bf16_vs_f32'], 1.0)})")
    if "components_ms" in size:
      print_torch(size_name, size)
  if not results["nnx_jit_tree_available"]:
    print("nnx.jit has no graph= argument in this flax: the tree-mode variant was skipped")


def print_torch(size_name: str, size: dict[str, Any]) -> None:
  loss = size["first_loss"]
  print(f"{size_name:8} recipe / torch.compile = {size['ratio_recipe_vs_torch_compile']:.3f}, "
        f"recipe / torch eager = {size['ratio_recipe_vs_torch_eager']:.3f}, recipe bf16 / "
        f"torch.compile bf16 = {size['ratio_recipe_bf16_vs_torch_compile_bf16']:.3f}; first loss "
        f"jax {loss['jax']:.6f} torch {loss['torch']:.6f}")
  table = size["components_ms"]
  frameworks = list(table)
  print(f"\n{size_name}: ms per step by part (per-block parts x {size['model']['num_layers']} "
        "layers, each timed alone)")
  print(f"{'part':18}" + "".join(f"{fw:>15}" for fw in frameworks) + f"{'ratio':>8}")
  for part in table[frameworks[0]]:
    values = [table[fw][part] for fw in frameworks]
    ratio = values[0] / values[1] if len(values) == 2 and values[1] > 0 else float("nan")
    print(f"{part:18}" + "".join(f"{v:15.2f}" for v in values) + f"{ratio:8.2f}")
  for fw in frameworks:
    if not size["components_add_up"][fw]:
      row = table[fw]
      print(f"{fw}: the parts sum to {row['step'] - row['everything else']:.2f} ms against a "
            f"{row['step']:.2f} ms step ({parts_off_by(row):.0%} off, over "
            f"{PARTS_TOLERANCE:.0%}): timed alone, they do not say where its step's time goes")
  for name, judged in size["torch_targets"].items():
    print(f"{size_name:8} {name} = {judged['value']:.3f} "
          f"(target <= {judged['target']}: {common.verdict(judged['value'], judged['target'])})")


def _size_list(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  unknown = [s for s in names if s not in SIZES]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown size {', '.join(unknown) or repr(text)}; choose from {', '.join(SIZES)}"
    )
  return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="benchmarks/train_step.py", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--sizes", type=_size_list, default=list(DEFAULT_SIZES),
                      help=f"comma-separated, from {', '.join(SIZES)} (default: tiny,medium)")
  parser.add_argument("--repeats", type=common.positive_int, default=None,
                      help="timed rounds; each variant runs one chunk of steps per round, "
                           "taking turns to go first; the median is reported "
                           "(default: 12 for tiny, 4 for medium)")
  parser.add_argument("--min-chunk-seconds", type=common.non_negative_float, default=0.25,
                      help="a timed chunk runs at least this long (default: 0.25), so that a "
                           "dispatch-bound step (small model, GPU) is timed over many steps "
                           "in flight, not one at a time")
  parser.add_argument("--matmul-n", type=common.positive_int, default=None,
                      help="side of the square matmul that measures the peak "
                           "(default: 2048 on CPU, 8192 on accelerators)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: the 'quick' size, 2 rounds of 1 step, a small matmul, "
                           "most XLA optimizations off (timings not representative)")
  parser.add_argument("--bf16", action="store_true",
                      help="also time the recipe with model.dtype=bfloat16 (parameters float32)")
  parser.add_argument("--torch", action="store_true",
                      help="also time the same step in PyTorch (eager, torch.compile; float32, "
                           "bfloat16 autocast), implies --bf16, and print a per-part table; "
                           "needs torch (pip install jax-ai-stack[bench])")
  parser.add_argument("--torch-threads", type=common.positive_int, default=None,
                      help="torch.set_num_threads in the PyTorch process (default: torch's, "
                           "one per core); see benchmarks/README.md on a busy machine")
  common.add_out_argument(parser, "train_step")
  args = parser.parse_args(argv)
  if args.torch and not has_torch():
    parser.error("--torch needs PyTorch, which is not installed: "
                 "pip install 'jax-ai-stack[bench]' (or pip install torch)")
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
  with most_optimizations_disabled(args.quick):
    results = run(args)
  print_table(results)
  common.write(results, args.out)
  return results


def run(args: argparse.Namespace) -> dict[str, Any]:
  matmul_n = args.matmul_n or (2048 if jax.devices()[0].platform == "cpu" else 8192)
  peak = measure_matmul_peak(matmul_n)
  sizes = {
      name: bench_size(SIZES[name], args.repeats or SIZES[name].rounds, peak,
                       args.min_chunk_seconds, bf16=args.bf16, with_torch=args.torch,
                       torch_threads=args.torch_threads)
      for name in args.sizes
  }
  return {
      **common.header("train_step"),
      "flax": flax.__version__,
      "optimizer": OPTIM_CONFIG.name,
      "matmul_n": matmul_n,
      "matmul_peak_tflops": peak / 1e12,
      "target_ratio": TARGET_RATIO,
      "nnx_jit_tree_available": has_tree_mode_jit(),
      "quick": args.quick,
      "torch": next((s["torch_process"]["torch"] for s in sizes.values() if "torch_process" in s), None),
      "sizes": sizes,
  }


if __name__ == "__main__":
  main(sys.argv[1:])
