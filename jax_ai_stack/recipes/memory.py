"""The memory plan: the bytes each device needs for a recipe, before anything runs.

`estimate_memory(config, devices)` answers "does it fit, and how large a batch
fits?" from the config alone, for any number of devices (an int is a mesh of
that many simulated devices: a `jax.sharding.AbstractMesh`, no hardware), or for
a TPU slice or GPU host this machine does not have (a `topology.Topology` or its
name, `"v5e:2x2"`: its compile-only devices, the kernels its chip would run, and
its HBM for the largest batch). Per device it counts:

* parameters and optimizer state: exact. The model and optimizer are built
  abstractly (`nnx.eval_shape`, nothing allocated), the mesh rules give each
  array's `NamedSharding`, and `shard_shape` its per-device block: the same
  numbers as `array.addressable_shards[0].data.nbytes` of the real state.
* gradients: one per parameter that trains, laid out like it (under `fsdp`
  XLA reduce-scatters them), so exact in the same way. The model is the
  run's, after its transforms (`Task.model_transforms`): with LoRA the
  optimizer state and gradients are the adapters', and a full fine-tuning
  DPO run's frozen copy of the base, and a distillation run's teacher, are counted
  as "reference".
* gathered weights: a matmul of batch-split activations needs its weight
  whole along the mesh axes that split the batch, so under `fsdp` XLA
  all-gathers it; without remat the gathered copy stays live from the
  forward to the backward pass (measured on CPU: the whole model's), with
  remat each block gathers again when it is recomputed (one block's). The
  embedding's copy, gathered for the lookup, is dropped before the blocks run
  where the head has weights of its own (untied): Llama-3-8B shapes on a
  v5e-16, 0.98 GiB of the plan XLA does not hold.
* activations: an estimate of what the forward pass keeps for the backward
  pass. Where the Task knows it, analytic (`Task.activation_bytes`; the llama
  family's is `models.decoder.activation_bytes`, with what the platform's XLA
  keeps: a TPU's or GPU's fuses elementwise ops into the backward pass); for
  other families, and for a small model on a topology (`MEASURED_BELOW`),
  measured: XLA's temporary bytes of the train step compiled for one device's
  rows on the local backend (a topology's: on its chip, with its kernels), less
  the gradients (`compiled.memory_analysis()`; the pinned jax reports them on
  CPU too).
* float32 copies (this host's CPU devices only; not for a device count, which plans for
  an accelerator): XLA:CPU computes a bfloat16 matmul in float32, so the
  step holds a float32 copy of each bfloat16 weight it multiplies (twice the weight's
  bytes), and of a tied embedding a second, transposed for the head. Measured at
  Qwen3-0.6B's shapes: 2.80 GiB of a LoRA step's 3.50 GiB of temporaries.
* checkpoint (this host's CPU devices only): Orbax copies the saved state to host memory
  and writes it in the background while the next steps run; on a CPU that memory is the
  devices'. A full fine-tune at Qwen3-0.6B's shapes peaks in the step after the first
  checkpoint, 3.3 GiB over the step alone.
* code: the compiled step's, where it has been compiled for the chip
  (`aot.compile_recipe`, whose XLA reports it); 0 before.

What is not counted: the input batch, XLA's working space for the optimizer
update and collectives, fragmentation. Leave headroom: the largest batch is an
upper bound for the estimate, not a promise.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> plan = estimate_memory(config.load("lm-tiny"), 8, attention="xla")
  >>> plan.mesh, plan.rows_per_device
  ({'data': 8, 'fsdp': 1, 'expert': 1, 'tensor': 1}, 1)
  >>> format_bytes(plan.parameters), format_bytes(plan.optimizer)  # AdamW: two moments.
  ('3.19 MiB', '6.38 MiB')
  >>> plan.max_batch_size(parse_bytes("1GiB")) > plan.batch_size
  True
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

from jax_ai_stack import kernels, topology
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import measured_activations, optim, sample_memory, sharding, tasks
from jax_ai_stack.recipes.byte_sizes import format_bytes, parse_bytes  # noqa: F401
from jax_ai_stack.recipes.transforms import Frozen

RUNTIME_ALLOWANCE = parse_bytes("1.5GiB")
"""On a CPU, the process's own memory beside the plan's arrays (Python, jax, XLA's runtime and
compiled programs), which the plan states but does not count: each step of
`benchmarks/real_size.py --quick`, whose arrays are a few MiB, peaks at 330-480 MiB."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of one training step of a recipe on a mesh."""

  mesh: Mapping[str, int]
  """Each mesh axis's size (data, fsdp, expert, tensor)."""
  rules: str
  """The rule set that places the arrays (`mesh.rules`)."""
  batch_size: int
  """Global rows of the largest forward and backward pass: `data.batch_size`, or the largest
  of `data.batch_schedule`, in micro-batches of at most `train.microbatch_size`."""
  batch_ways: int
  """Devices that split the batch (the mesh axes "batch" maps to)."""
  parameters: int
  """The model's state (parameters, and RNG state if it keeps any)."""
  reference: int
  """Frozen weights: a copy of the base's (DPO's reference in full fine-tuning), or a
  distillation run's teacher; else 0."""
  optimizer: int
  """The optimizer's state (moments, step count, accumulated gradients)."""
  gradients: int
  """One gradient per parameter, laid out like it."""
  gathered: int
  """Weights all-gathered over the batch's mesh axes for the matmuls (fsdp)."""
  activations_per_row: int
  """Activation bytes per row of this device's share of the batch."""
  activations_from: str
  """How the activations were obtained (analytic or measured, and with what)."""
  device_memory: int | None = None
  """Bytes of HBM of the topology's chip the plan is for (None: no topology given)."""
  float32_copies: int = 0
  """XLA:CPU's float32 copies of the bfloat16 weights the step multiplies; 0 elsewhere."""
  checkpoint_copy: int = 0
  """On this host's CPU devices: the copy of the saved state a checkpoint is written from
  while the next steps run (Orbax copies it to host memory, which on a CPU is the devices'
  memory; elsewhere it is the host's, not a device's); 0 elsewhere."""
  code: int = 0
  """The compiled program's code, which XLA keeps on every device (4-20 MiB on a TPU):
  known once the step is compiled for the chip (`aot`), else 0, and left out."""
  runtime: int = 0
  """On this host's CPU: `RUNTIME_ALLOWANCE`, the process's own memory beside the arrays (not
  in `total`); 0 elsewhere, where the process is in the host's memory, not a device's."""
  sampling: int = 0
  """On this host's CPU, a run that samples at its end: what its decoding call holds beside
  the train state (`sample_memory.decoding_bytes`: a LoRA run's merged copy, XLA:CPU's float32
  copies, the pages); 0 elsewhere."""

  @property
  def rows_per_device(self) -> int:
    return self.batch_size // self.batch_ways

  @property
  def activations(self) -> int:
    return self.activations_per_row * self.rows_per_device

  @property
  def fixed(self) -> int:
    """Bytes that do not depend on the batch size."""
    return (self.parameters + self.reference + self.optimizer + self.gradients + self.gathered
            + self.float32_copies + self.checkpoint_copy + self.code)

  @property
  def total(self) -> int:
    return self.fixed + self.activations

  @property
  def while_sampling(self) -> int:
    """The end-of-run sample's bytes with the train state it decodes beside (the gradients
    and activations are gone by then); 0 where the plan does not count a sample."""
    if not self.sampling:
      return 0
    return self.parameters + self.reference + self.optimizer + self.sampling

  @property
  def peak(self) -> int:
    """The larger of a step's bytes and the end-of-run sample's: what must fit."""
    return max(self.total, self.while_sampling)

  def max_batch_size(self, device_memory: int) -> int:
    """The largest global batch whose estimate fits `device_memory` bytes per device.

    A multiple of `batch_ways` (every device gets whole rows); 0 when not even
    the parameters, optimizer state and gradients fit.
    """
    room = device_memory - self.fixed
    if room < self.activations_per_row:
      return 0
    return room // max(self.activations_per_row, 1) * self.batch_ways

  def describe(self, device_memory: int | None = None) -> str:
    """The plan as a few human-readable lines (what `train --dry-run` prints); against
    `device_memory` bytes per device, by default the topology's chip's."""
    device_memory = self.device_memory if device_memory is None else device_memory
    devices = math.prod(self.mesh.values())
    mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh.items())
    lines = [
        f"mesh {mesh} ({devices} device{'s' if devices > 1 else ''}), rules {self.rules}; "
        f"global batch {self.batch_size} ({_rows(self.rows_per_device)} per device)",
        "per-device memory plan:",
        f"  parameters   {format_bytes(self.parameters):>11}",
        *([f"  reference    {format_bytes(self.reference):>11}  (frozen: DPO's copy of the "
           "base, or a distillation teacher)"] if self.reference else []),
        f"  optimizer    {format_bytes(self.optimizer):>11}",
        f"  gradients    {format_bytes(self.gradients):>11}",
        f"  gathered     {format_bytes(self.gathered):>11}  (weights gathered for the matmuls)",
        f"  activations  {format_bytes(self.activations):>11}  ({self.activations_from})",
        *([f"  float32      {format_bytes(self.float32_copies):>11}  (XLA:CPU's copies of the "
           "bfloat16 weights for its matmuls)"] if self.float32_copies else []),
        *([f"  checkpoint   {format_bytes(self.checkpoint_copy):>11}  (the saved state's copy "
           "a checkpoint is written from, beside the next steps)"] if self.checkpoint_copy
          else []),
        *([f"  code         {format_bytes(self.code):>11}  (XLA's, of the compiled step)"]
          if self.code else []),
        f"  total        {format_bytes(self.total):>11}",
        *([f"  sampling     {format_bytes(self.while_sampling):>11}  (the end-of-run sample: "
           f"its decoding call's {format_bytes(self.sampling)} beside the train state)"]
          if self.sampling else []),
        *([f"  runtime   <= {format_bytes(self.runtime):>11}  (not in the total: the process "
           "itself, Python, jax and XLA's compiled programs)"] if self.runtime else []),
    ]
    if device_memory is None:
      lines.append("device memory unknown (this backend reports none): pass --device-memory, "
                   "e.g. 16GiB, for the largest batch that fits")
    else:
      largest = self.max_batch_size(device_memory)
      fits = "fits" if self.peak <= device_memory else "does NOT fit"
      lines.append(f"device memory {format_bytes(device_memory)}: this batch {fits}; largest "
                   f"global batch {largest:,} ({_rows(largest // self.batch_ways)} per device)")
    return "\n".join(lines)


def _rows(n: int) -> str:
  return f"{n:,} row{'' if n == 1 else 's'}"


def abstract_mesh(config: sharding.MeshConfig, device_count: int) -> AbstractMesh:
  """The run's `data x fsdp x expert x tensor` mesh for `device_count` devices, no devices."""
  shape = sharding.mesh_shape(config, device_count)
  return AbstractMesh(tuple(shape.values()), tuple(shape),
                      axis_types=(AxisType.Auto,) * len(shape))


def estimate_memory(config: Any,
                    devices: int | Mesh | AbstractMesh | topology.Topology | str, *,
                    attention: str | None = None, environ: Mapping[str, str] | None = None,
                    autotune_file: str | os.PathLike | None = None) -> MemoryPlan:
  """The per-device memory plan of one training step of `config`.

  Args:
    config: a recipe config (`config.load(...)`).
    devices: a device count (the mesh `config.mesh` gives for that many
      devices, simulated), a mesh, or a topology (`topology.Topology`, or its
      name: `topology.load`), whose compile-only devices the mesh is made of.
      On a mesh of devices (a topology's, or a `Mesh`) the kernels are those
      of their chip, and measured activations are compiled for it.
    attention: the attention kernel the llama estimate assumes (a name of
      `kernels.IMPLEMENTATIONS`); None: the one the config selects on the
      devices' backend, as the trainer would (`kernels.plan_for_run` of the
      config, `environ` and `autotune_file`).
    environ: the environment the caller read (`JAX_AI_STACK_ATTENTION`);
      None: the process's, now.
    autotune_file: the workdir's autotune file, or None.

  Raises:
    ConfigError: the mesh does not fit the device count, or an array or the
      batch does not divide by its mesh axes (the trainer's own messages).
    UsageError: an unknown topology, or libtpu (the CUDA plugin) missing.
  """
  target = topology.load(devices) if isinstance(devices, str) else devices
  if isinstance(target, topology.Topology):
    mesh = sharding.build_mesh(config.mesh, target.devices)
  else:
    mesh = abstract_mesh(config.mesh, devices) if isinstance(devices, int) else devices
  device = _foreign_device(mesh)
  rules = sharding.logical_rules(config.mesh)
  task = tasks.for_config(config)
  transforms = task.model_transforms()
  plan = None
  if task.attention_request() is not None:
    plan, attention = _attention(task, attention, device, environ, autotune_file)

  def create(plan=plan, run=config):  # `run`: the config, or one with fewer layers.
    built = task if run is config else tasks.for_config(run)
    model = transforms.apply(built.build_model(run.train.seed, plan))
    return model, optim.build_optimizer(run.optim, model, train_steps=run.train.steps,
                                        wrt=transforms.wrt)

  model, optimizer = nnx.eval_shape(create)
  host_cpu = isinstance(mesh, Mesh) and mesh.devices.flat[0].platform == "cpu"
  sampling = 0
  if host_cpu and tasks.lm.SAMPLE_FILE in task.artefacts():  # It samples at its end.
    sampling = sample_memory.of_run(task, transforms, model, plan)
  micro = config.train.microbatch_size
  batch_size = max(size if micro is None else min(size, micro)
                   for _, size in config.data.batch_sizes())
  batch_size = _step_rows(task, batch_size)
  sharding.batch_shardings(task.batch_axes(), {k: (batch_size,) for k in task.batch_axes()},
                           mesh, rules)  # Raises ConfigError if the batch does not divide.
  ways = {name: math.prod(mesh.shape[axis] for axis in axes) for name, axes in rules.items()}
  batch_ways = ways.get("batch", 1)
  params = nnx.state(model, nnx.Param)
  gathered = _gathered_bytes(params, mesh, rules)
  if getattr(config.model, "tie_embeddings", True) is False:  # A head of its own.
    # The embedding is gathered for the lookup at the step's start and dropped: the blocks
    # do not read it, nor does its gradient (the looked-up rows' scatter).
    gathered = {path: n for path, n in gathered.items() if not path.startswith("embed/")}
  platform = device.platform if device is not None else jax.default_backend()
  analytic = task.activation_bytes(ways, attention, platform)
  if analytic is None or _small_on(device, target, model, optimizer):
    per_row, source = measured_activations.per_row(  # Here: this host's kernels.
        task, task.training_loss(transforms), model, optimizer, batch_size // batch_ways, device,
        rebuild=lambda run, here: nnx.eval_shape(lambda: create(None if here else plan, run)))
  else:
    per_row, source = analytic
  remat, layers = getattr(config.model, "remat", "none"), getattr(config.model, "num_layers", 1)
  if remat != "none":  # Blocks gather again when recomputed: one at a time.
    blocks = sum(n for path, n in gathered.items() if "/layers/" in f"/{path}")
    gathered = {"blocks": blocks // layers,
                **{path: n for path, n in gathered.items() if "/layers/" not in f"/{path}"}}
  return MemoryPlan(
      mesh=dict(mesh.shape), rules=config.mesh.rules, batch_size=batch_size,
      batch_ways=batch_ways,
      parameters=device_bytes(nnx.state(model, nnx.Not(Frozen)), mesh, rules),
      reference=device_bytes(nnx.state(model, Frozen), mesh, rules),
      optimizer=device_bytes(nnx.state(optimizer), mesh, rules),
      gradients=device_bytes(nnx.state(model, transforms.wrt), mesh, rules),
      gathered=sum(gathered.values()),
      float32_copies=(_float32_copies(model, gathered, mesh, rules,
                                      tied=getattr(config.model, "tie_embeddings", True))
                      if host_cpu else 0),
      checkpoint_copy=(device_bytes(transforms.saved(nnx.state((model, optimizer))), mesh,
                                    rules) if host_cpu else 0),
      activations_per_row=per_row, activations_from=source,
      device_memory=target.chip.hbm_bytes if isinstance(target, topology.Topology) else None,
      runtime=RUNTIME_ALLOWANCE if host_cpu else 0, sampling=sampling,
  )


MEASURED_BELOW = 16
"""On a topology's chip, a model whose whole train state is under 1/MEASURED_BELOW of the
chip's HBM has its activations measured there, not estimated: compiling its one-device step
takes seconds, and the analytic estimate does not see what that chip's XLA does at such
sizes. XLA:TPU lays arrays out in tiles of 8 x 128 (lm-tiny's heads of 32 take 128 lanes),
keeps a float32 matmul's operands in bfloat16 (its default precision makes one bfloat16
pass), and fuses the SwiGLU's elementwise ops into the backward pass (it keeps gate and up,
not their products): lm-tiny-grpo, 32 rows of 64 tokens a device on v5e:2x2, keeps 0.6 of
the estimate. A larger model is estimated (a one-device compile of an 8B step takes
minutes, and it would not fit a chip)."""


def _small_on(device: Any, target: Any, model: nnx.Module, optimizer: nnx.Optimizer) -> bool:
  """Whether the activations are measured on `device`, a topology's chip (`MEASURED_BELOW`)."""
  if device is None or not isinstance(target, topology.Topology):
    return False
  state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state((model, optimizer))))
  return state * MEASURED_BELOW <= target.chip.hbm_bytes


def _step_rows(task: tasks.Task, rows: int) -> int:
  """Rows of the step that trains on `rows` rows of data: a run on prompts trains on each
  prompt's `rl.num_generations` completions (`Task.batch_spec`)."""
  try:
    spec = task.batch_spec(rows)
  except NotImplementedError:  # An objective that does not describe its batch.
    return rows
  return jax.tree.leaves(spec)[0].shape[0] if spec else rows


def device_bytes(abstract_state: Any, mesh: Mesh | AbstractMesh, rules: sharding.Rules) -> int:
  """Bytes of one device's shards of an abstract state laid out by `rules`."""
  return sum(_shard_bytes(abstract_state, mesh, rules).values())


def _shard_bytes(abstract_state: Any, mesh: Mesh | AbstractMesh,
                 rules: sharding.Rules) -> dict[str, int]:
  """{'layers/0/mlp/up_proj/kernel/value': bytes of one device's shard}."""
  shardings = jax.tree.leaves(sharding.state_shardings(abstract_state, mesh, rules))
  return {
      jax.tree_util.keystr(path, simple=True, separator="/"):
          math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
      for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract_state), shardings)}


def _float32_copies(model: nnx.Module, gathered: dict[str, int], mesh: Mesh | AbstractMesh,
                    rules: sharding.Rules, *, tied: bool) -> int:
  """Bytes of the float32 copies XLA:CPU makes of the bfloat16 weights a step multiplies
  (each device's share, whole where it is gathered): twice their bfloat16 bytes, and a
  tied embedding's twice again (its transposed copy for the head)."""
  weights = nnx.state(model, nnx.Any(nnx.Param, Frozen))
  shares = _shard_bytes(weights, mesh, rules)
  dtypes = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf.dtype
            for path, leaf in jax.tree_util.tree_leaves_with_path(weights)}
  total = 0
  for path, share in shares.items():
    if dtypes[path] != jnp.bfloat16:
      continue
    share = max(share, gathered.get(path, 0))
    total += 2 * share * (2 if tied and "/embed/" in f"/{path}" else 1)
  return total


def _gathered_bytes(params: Any, mesh: Mesh | AbstractMesh,
                    rules: sharding.Rules) -> dict[str, int]:
  """Per parameter split over a mesh axis of the batch: its bytes gathered over those axes.

  Not over the experts' axes: expert parallelism sends tokens to the experts' devices
  and keeps each expert where it lives (`models.moe`)."""
  batch = set(rules.get("batch", ()))
  whole = {name: tuple(a for a in axes if a not in batch or name == "experts")
           for name, axes in rules.items()}
  split, gathered = _shard_bytes(params, mesh, rules), _shard_bytes(params, mesh, whole)
  return {path: n for path, n in gathered.items() if n != split[path]}


def _foreign_device(mesh: Mesh | AbstractMesh) -> Any:
  """A device of `mesh` if they are another backend's than this host's (a topology's
  compile-only devices), else None: the plan then selects and measures here, as before."""
  if not isinstance(mesh, Mesh):
    return None
  device = mesh.devices.flat[0]
  return device if device.platform != jax.default_backend() else None


def _attention(task: tasks.Task, name: str | None, device: Any,
               environ: Mapping[str, str] | None,
               autotune_file: str | os.PathLike | None) -> tuple[kernels.AttentionPlan | None, str]:
  """(the plan the model is built with, its kernel's name): kernel `name`, or where None
  the one a fresh run would train with on `device`'s chip (`kernels.plan_for_run`'s
  precedence; None: this backend). The plan is None on this host's backend without a
  device: the model's own choice, as before topologies."""
  backend = None if device is None else kernels.backend_of(device)
  if name is not None:
    plan = None if backend is None else kernels.AttentionPlan((name,), "the memory plan",
                                                              backend=backend)
    return plan, name
  with kernels.compiling_for(backend.platform if backend else jax.default_backend()):
    plan, choice = kernels.plan_for_run(task.attention_request(),
                                        task.attention_implementation(), environ=environ,
                                        autotune_file=autotune_file, backend=backend,
                                        probe=True if backend else None)
  return (plan if backend else None), choice.name


def device_memory() -> int | None:
  """Bytes of memory of this process's first device, if the backend says (not CPU)."""
  return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def dry_run(config: Any, *, device_memory_text: str | None = None,
            environ: Mapping[str, str] | None = None,
            autotune_file: str | os.PathLike | None = None) -> str:
  """What `jax-ai-stack train --dry-run` prints: the plan on this host's devices.

  The device memory is `device_memory_text` if given, else what the device
  reports; the attention kernel the one `environ` and `autotune_file` select,
  as for training. Nothing is trained, allocated, or written.
  """
  memory = parse_bytes(device_memory_text) if device_memory_text else device_memory()
  plan = estimate_memory(config, sharding.build_mesh(config.mesh, jax.devices()), environ=environ,
                         autotune_file=autotune_file)  # This host's: on a CPU, its copies.
  return f"recipe {config.name} on {jax.device_count()} {jax.default_backend()} device(s)\n" + (
      plan.describe(memory))
