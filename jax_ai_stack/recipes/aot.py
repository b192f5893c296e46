"""A recipe's programs compiled ahead of time for chips this machine does not have.

`jax-ai-stack train RECIPE --dry-run --topology v5e:2x2` is MaxText's `train_compile` for
any recipe: the run is built abstractly over the compile-only devices of a TPU slice or
GPU host (`jax_ai_stack.topology`), with the mesh `mesh.*` asks for and the kernels that
chip would run (selected for its devices, probed as there), and its train and eval steps
are lowered over `ShapeDtypeStruct`s laid out on that mesh and compiled by the chip's own
XLA. Nothing is allocated, no workdir is touched, no weights are read.

XLA's memory analysis of a compiled program is the chip's per-device bytes: they are
printed beside the memory plan (`memory.estimate_memory`, the same mesh and kernel) and
the chip's HBM. Its cost analysis gives the step's flops and bytes, and so a roofline:
the step cannot take less than max(flops / peak, bytes / bandwidth), and the fraction of
that time the flops need is the MFU it cannot exceed.

Example: (needs libtpu; tests/test_aot.py runs it)
  >>> from jax_ai_stack import topology
  >>> from jax_ai_stack.recipes import config
  >>> compiled = compile_recipe(config.load("lm-tiny"), topology.load("v5e:2x2"),
  ...                           environ={})  # doctest: +SKIP
  >>> print(compiled.describe())  # doctest: +SKIP
  recipe lm-tiny on v5e:2x2: 4 x TPU v5 lite (compile-only; ...)
  attention: tokamax_mosaic_tpu
  ...
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from jax_ai_stack import kernels, topology
from jax_ai_stack.kernels import lowering
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import memory, optim, sample_memory, sharding, step, tasks

__all__ = ["Compiled", "Program", "compile_recipe", "dry_run"]

ENGINE = "engine"
"""The first word of the engine's programs' names."""


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program: XLA's per-device bytes and costs, and its compile time."""

  name: str
  seconds: float
  arguments: int
  outputs: int
  aliased: int
  """Output bytes that reuse an argument's buffer (a donated train state)."""
  temporaries: int
  code: int
  flops: float | None
  """XLA's count per device; None where the backend reports no cost analysis."""
  bytes_accessed: float | None
  shared: int = 0
  """Argument bytes the train state already holds (an engine decoding with the run's own
  parameters): counted once where both are on the device at once."""
  kernels: tuple[str, ...] = ()
  """The Pallas kernels in the compiled program: proof of what the chip would run."""
  peak: int = 0
  """XLA's peak heap, arguments included, code not; 0 where the backend reports none (GPU).
  XLA:TPU's temporaries leave out most of what a backward pass keeps (lm-tiny on v5e:2x2
  at 16 rows a device: 9 MiB of temporaries, a 114 MiB peak)."""

  @classmethod
  def of(cls, name: str, compiled: Any, seconds: float, shared: int = 0) -> Program:
    stats = compiled.memory_analysis()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs  # Older jax: one per program.
    return cls(name, seconds, stats.argument_size_in_bytes, stats.output_size_in_bytes,
               stats.alias_size_in_bytes, stats.temp_size_in_bytes,
               stats.generated_code_size_in_bytes,
               costs.get("flops") if costs else None, costs.get("bytes accessed") if costs else None,
               shared, pallas_kernels(compiled.as_text()),
               int(getattr(stats, "peak_memory_in_bytes", 0) or 0))

  @property
  def total(self) -> int:
    """What the program holds on a device at once: its peak heap and code where XLA reports
    a peak, else its buffers (a donated argument counted once) and code."""
    if self.peak:
      return self.peak + self.code
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  def roofline(self, chip: topology.Chip) -> tuple[float, float] | None:
    """(the least time the step can take, the MFU it cannot exceed) on `chip`; None without
    the costs or the chip's peak."""
    if not (self.flops and self.bytes_accessed and chip.bf16_flops_per_s):
      return None
    compute = self.flops / chip.bf16_flops_per_s
    least = max(compute, self.bytes_accessed / chip.hbm_bytes_per_s)
    return least, compute / least

  def describe(self, chip: topology.Chip) -> str:
    f = memory.format_bytes
    peak = f"peak heap {f(self.peak)}, " if self.peak else ""
    lines = [f"{self.name}: compiled in {self.seconds:.1f} s; per device {f(self.total)} of "
             f"{f(chip.hbm_bytes)} HBM ({self.total / chip.hbm_bytes:.1%}): {peak}arguments "
             f"{f(self.arguments)}, outputs {f(self.outputs)} ({f(self.aliased)} of them in "
             f"donated arguments), temporaries {f(self.temporaries)}, code {f(self.code)}"]
    if self.kernels:
      lines.append(f"  Pallas kernels: {', '.join(self.kernels)}")
    roofline = self.roofline(chip)
    if roofline is None:
      lines.append("  flops and bytes: XLA reports no cost analysis for this program here"
                   if self.flops is None else "  roofline: the chip's peak is unknown")
    else:
      least, mfu = roofline
      bound = "compute" if mfu > 0.999 else "memory"
      lines.append(f"  {self.flops / 1e9:,.3g} GFLOP and {self.bytes_accessed / 1e6:,.3g} MB "
                   f"per device: at least {least * 1e3:.3g} ms a step ({bound}-bound), MFU at "
                   f"most {mfu:.0%}")
    return "\n".join(lines)


_WRAPPERS = re.compile(r"while|body|cond|branch_\d+|eval_jaxpr|checkpoint|remat\d*|"
                       r"(jvp|transpose|vmap|jit|shard_map|pjit)(\(.*\))?")
"""Op-name path elements that wrap a kernel's call rather than name it."""


def pallas_kernels(hlo_text: str) -> tuple[str, ...]:
  """The names of the Pallas kernels a compiled program calls, read from its ops' metadata
  (`.../splash_mha_fwd_residuals/while/body/pallas_call` gives splash_mha_fwd_residuals).

  Example:
    >>> pallas_kernels('op_name="jit(f)/jit(ragged)/ragged_kernel/pallas_call" '
    ...                'op_name="jit(g)/flash_fwd/while/body/eval_jaxpr/pallas_call"')
    ('flash_fwd', 'ragged_kernel')
  """
  names = set()
  for path in re.findall(r'op_name="([^"]*)/pallas_call"', hlo_text):
    parts = [p for p in path.split("/") if not _WRAPPERS.fullmatch(p)]
    if parts:
      names.add(parts[-1])
  return tuple(sorted(names))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a recipe compiles to on a topology, and what it needs there."""

  recipe: str
  target: topology.Topology
  attention: kernels.Choice | None
  refused: tuple[str, ...]
  """'name: why' of each kernel chosen first that the chip's compiler refused."""
  grouped_matmul: tuple[str, str]
  paged_attention: tuple[str, str]
  plan: memory.MemoryPlan
  programs: tuple[Program, ...]
  deterministic: bool = False
  """`train.deterministic`, which a GPU run sets XLA's deterministic ops for."""
  group: int = 1
  """Rows a step trains on per example of data.batch_size (rl.num_generations on prompts)."""

  @property
  def largest(self) -> Program:
    return max(self.programs, key=lambda p: p.total)

  @property
  def train(self) -> Program:
    """The train step: what the memory plan is for (it does not count an engine's pool)."""
    return self.programs[0]

  @property
  def sampling(self) -> int | None:
    """Per-device bytes while the run samples (RL's rollouts, an evaluation that generates):
    the train state, which stays on the device, beside the engine's largest program (its
    page pool, its temporaries); None for a run that does not generate."""
    engine = [p for p in self.programs if p.name.startswith(ENGINE)]
    if not engine:
      return None
    return self.train.arguments + max(p.total - p.shared for p in engine)

  def describe(self) -> str:
    chip = self.target.chip
    lines = [f"recipe {self.recipe} on {self.target.describe()}"]
    if self.attention is not None:
      lines.append(f"attention: {self.attention.name}{_fallbacks(self.attention)}")
      lines += [f"  chosen first, refused by the compiler: {refused}" for refused in self.refused]
    lines += [f"grouped matmul (MoE experts): {self.grouped_matmul[0]} ({self.grouped_matmul[1]})",
              f"paged attention (decoding): {self.paged_attention[0]} "
              f"({self.paged_attention[1]})"]
    if self.target.name.platform == "gpu" and self.deterministic:
      lines.append("compiled without XLA's deterministic GPU ops (train.deterministic): "
                   "without a GPU, XLA finds no GEMM configuration under them")
    lines += [program.describe(chip) for program in self.programs]
    if self.sampling is not None:
      lines.append(f"while sampling: {memory.format_bytes(self.sampling)} per device (the train "
                   "state beside the engine's pages and temporaries)")
    lines.append(self.plan.describe(chip.hbm_bytes))
    train = self.train
    lines.append(f"XLA / memory plan: {train.total / max(self.plan.total, 1):.2f} "
                 f"({train.name}: {memory.format_bytes(train.total)} per device, plan "
                 f"{memory.format_bytes(self.plan.total)})")
    return "\n".join(lines)

  def check_fits(self) -> None:
    """A `UsageError` naming the program that does not fit the chip's HBM, and the largest
    batch the plan says does."""
    largest, hbm = self.largest, self.target.chip.hbm_bytes
    needs = [(largest.total, f"its {largest.name}")]
    if self.sampling is not None:
      needs.append((self.sampling, "its train state beside the engine while sampling"))
    total, what = max(needs)
    if total > hbm:
      raise UsageError(
          f"{self.recipe} does not fit {self.target.name.text}: {what} needs "
          f"{memory.format_bytes(total)} per device, the {self.target.chip.device_kind} "
          f"has {memory.format_bytes(hbm)}; "
          f"{_largest_batch(self.plan, self.target.chip, self.group)}")


def _fallbacks(choice: kernels.Choice) -> str:
  """' (over X: why; ...)' for the kernels ahead of the chosen one that were rejected."""
  ahead = choice.order[:choice.order.index(choice.name)] if choice.name in choice.order else ()
  rejected = [v for v in choice.verdicts if v.name in ahead and v.status == "rejected"]
  return " (over " + "; ".join(f"{v.name}: {v.reason}" for v in rejected) + ")" if rejected else ""


def compile_recipe(config: Any, target: topology.Topology, *,
                   environ: Mapping[str, str]) -> Compiled:
  """`config`'s train and eval steps compiled for `target`'s devices (see the module).

  Raises:
    ConfigError: the mesh does not divide the topology's devices, or the batch its axes
      (the trainer's own messages).
    NoImplementationError: no attention kernel fits on that chip.
  """
  task = tasks.for_config(config)
  group = config.rl.num_generations if task.rollouts is not None else 1
  backend = kernels.backend_of(target.devices[0])
  mesh = sharding.build_mesh(config.mesh, target.devices)
  placement = sharding.Placement(mesh, sharding.logical_rules(config.mesh), task.batch_axes())
  transforms = task.model_transforms()
  with kernels.compiling_for(backend.platform):
    plan, choice, refused = _attention_that_compiles(task, environ, target.devices[0])

    def create():
      model = transforms.apply(task.build_model(config.train.seed, plan, placement.layout()))
      return model, optim.build_optimizer(config.optim, model, train_steps=config.train.steps,
                                          wrt=transforms.wrt)

    model, optimizer = nnx.eval_shape(create)
    state_sharding = placement.state_shardings(nnx.state((model, optimizer)))
    train_step, eval_step, abstract = step.make_steps(
        model, optimizer, task.training_loss(transforms), state_sharding=state_sharding,
        microbatch_size=getattr(config.train, "microbatch_size", None))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, state_sharding)
    plan_bytes = memory.estimate_memory(config, target, attention=choice.name if choice else None,
                                        environ=environ)
    rows = max(size for _, size in config.data.batch_sizes())
    batch = _batch(task, placement, rows)
    try:
      programs = (_compiled("train step", mesh, lambda: train_step.lower(state, batch)),
                  _compiled("eval step", mesh, lambda: eval_step.lower(state, batch)),
                  *_engine_programs(task, config, target, placement, model, plan))
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise UsageError(  # XLA:TPU refuses a program larger than HBM as it compiles it.
          f"{config.name} does not fit {target.name.text}: {str(e).strip().splitlines()[0]}; "
          f"{_largest_batch(plan_bytes, target.chip, group)}") from None
  plan_bytes = dataclasses.replace(plan_bytes, code=programs[0].code)  # Known once compiled.
  moe = getattr(config.model, "moe", None)  # What the model's experts were built with.
  grouped = kernels.choose_grouped_matmul(moe.grouped_matmul if moe else "auto",
                                          backend.platform, backend.device_kind)
  if backend.platform == "gpu" and grouped[0] == "tokamax":  # kernels.experts says why.
    grouped = (grouped[0], f"{grouped[1]}; compiled here as XLA's ragged_dot: tokamax's GPU "
                           "kernels read this host's device")
  sinks = bool(getattr(config.model, "attention_sinks", False))  # Only xla takes them,
  chunked = getattr(config.model, "attention_chunk_size", None) is not None  # and chunks.
  paged = (plan.paged_attention(sinks=sinks, chunked=chunked) if plan is not None else
           kernels.choose_paged_attention("auto", backend.platform, backend.device_kind,
                                          sinks=sinks, chunked=chunked))  # What it decodes with.
  return Compiled(
      config.name, target, choice, refused, grouped, paged, plan_bytes, programs,
      deterministic=bool(getattr(config.train, "deterministic", False)), group=group)


def _engine_programs(task: tasks.Task, config: Any, target: topology.Topology,
                     placement: sharding.Placement, model: nnx.Module,
                     plan: kernels.AttentionPlan | None) -> tuple[Program, ...]:
  """The generation engine's prefill and decoding programs, compiled as the run would build
  its engine on `target`: RL's rollouts (a slot per completion of a process's prompts, up to
  `rollout.MAX_SLOTS`) and an in-training evaluation's generations (`in_training.BATCH_SIZE`
  slots); a rollout's slot holds `data.seq_len + 1` positions, an evaluation's the model's whole
  context (lm-eval's `max_length`). On one host the engine
  decodes with the run's model (abstract `model`, built with attention `plan`; a LoRA run's
  merged), placed on the mesh; on several, each process with a whole copy on its first
  device (`sharding.on_this_process`)."""
  from jax_ai_stack.recipes import inference  # pylint: disable=g-import-not-at-top

  processes = len({device.process_index for device in target.devices})
  if task.rollouts is not None:
    from jax_ai_stack.recipes.rl import rollout  # pylint: disable=g-import-not-at-top
    prompts = max(size for _, size in config.data.batch_sizes()) // processes
    slots, what = min(prompts * config.rl.num_generations, rollout.MAX_SLOTS), "rollout"
    max_len = min(config.data.seq_len + 1, config.model.max_seq_len)  # As `Rollouts` sizes it.
  elif config.train.eval_tasks:
    from jax_ai_stack.recipes.evaluation import in_training  # pylint: disable=g-import-not-at-top
    slots, what, max_len = in_training.BATCH_SIZE, "evaluation", None
  else:
    return ()
  # The run's model as it decodes (a LoRA run's merged), and whether it is the run's own weights.
  decoding, own = sample_memory.decoding_model(task, task.model_transforms(), model, plan)
  graphdef, params = nnx.split(decoding)
  if processes > 1:
    placed = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(target.devices[0]), params)
  else:
    placed = placement.state_shardings(params)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        params, placed)
  model = nnx.merge(graphdef, params)
  if processes > 1:  # As `sharding.on_one_device` makes it.
    model = sharding.without_mesh(model)
  shared = _device_bytes(params) if own and processes == 1 else 0
  engine = inference.Engine(model, max_slots=slots, max_len=max_len)
  where = jax.sharding.Mesh(target.devices[:1], ("one",)) if processes > 1 else placement.mesh
  return tuple(_compiled(f"{ENGINE} {what} {name}", where,
                         lambda name=name: engine.lower(name), shared=shared)
               for name in ("prefill", "decode"))


def _device_bytes(tree: Any) -> int:
  """The bytes one device holds of `tree`'s placed `ShapeDtypeStruct`s (the largest share)."""
  return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
             for s in jax.tree.leaves(tree))


def _largest_batch(plan: memory.MemoryPlan, chip: topology.Chip, group: int = 1) -> str:
  """The advice of a run that does not fit; `group` rows a step trains on per example of
  data.batch_size (a run on prompts: rl.num_generations completions of each)."""
  largest = plan.max_batch_size(chip.hbm_bytes) // group
  return (f"the largest global batch that fits is about {largest:,} (data.batch_size"
          f"{f', each prompt {group} completions' if group > 1 else ''}), or spread the state "
          "over more devices (mesh.fsdp)")


def _attention_that_compiles(task: tasks.Task, environ: Mapping[str, str], device: Any):
  """(plan, choice, refusals): the run's attention plan for `device`'s chip, its choice
  compiled alone (forward and backward, at the step's request) on that device, and, while
  the chip's compiler refuses a choice, the next kernel of the order, as on the chip."""
  backend, implementation = kernels.backend_of(device), task.attention_implementation()
  refused: list[str] = []
  while True:
    plan, choice = kernels.plan_for_run(task.attention_request(), implementation,
                                        environ=environ, backend=backend, probe=True)
    reason = None if choice is None else lowering.attention_compile_error(choice, device)
    if reason is None:
      return plan, choice, tuple(refused)
    refused.append(f"{choice.name}: {reason}{_fallbacks(choice)}")
    rest = choice.order[choice.order.index(choice.name) + 1:]
    if not rest:
      raise kernels.NoImplementationError(
          f"no attention kernel compiles for {device.device_kind}: " + "; ".join(refused))
    implementation = ",".join(rest)


def _batch(task: tasks.Task, placement: sharding.Placement, rows: int) -> dict[str, Any]:
  """One step's batch, abstract and laid out on the mesh as the trainer lays out real ones."""
  spec = task.batch_spec(rows)
  if spec is None:  # Only the data says: its first batch's fields.
    iterator = iter(task.dataset("train", task.config.train.seed))
    first = next(iterator)
    spec = {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype) for k, v in first.items()}
  shardings = sharding.batch_shardings(placement.batch_axes, {k: s.shape for k, s in spec.items()},
                                       placement.mesh, placement.rules)
  return {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k]) for k, s in spec.items()}


def _compiled(name: str, mesh: jax.sharding.Mesh, lower: Callable[[], Any], *,
              shared: int = 0) -> Program:
  """What `lower()` lowers, compiled, the target's `mesh` the abstract mesh meanwhile: a
  Pallas GPU kernel asks it which GPU to lower for (no layout sets one on one device)."""
  started = time.perf_counter()
  with lowering.no_persistent_cache(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = lower().compile()
  return Program.of(name, compiled, time.perf_counter() - started, shared)


def dry_run(config: Any, name: str, *, dry_run: bool, environ: Mapping[str, str]) -> int:
  """`train --dry-run --topology NAME`: prints `config` compiled for that topology; a
  `UsageError` (one line, exit 2) where it does not fit, or without --dry-run."""
  if not dry_run:
    raise UsageError("--topology compiles for chips this machine does not have: add --dry-run")
  compiled = compile_recipe(config, topology.load(name), environ=environ)
  print(compiled.describe(), flush=True)
  compiled.check_fits()
  return 0
