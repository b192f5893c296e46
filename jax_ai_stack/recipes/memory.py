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
  DPO run's frozen copy of the base is counted as "reference".
* gathered weights: a matmul of batch-split activations needs its weight
  whole along the mesh axes that split the batch, so under `fsdp` XLA
  all-gathers it; without remat the gathered copy stays live from the
  forward to the backward pass (measured on CPU: the whole model's), with
  remat each block gathers again when it is recomputed (one block's).
* activations: an estimate of what the forward pass keeps for the backward
  pass. Where the Task knows it, analytic (`Task.activation_bytes`; the llama
  family's is `models.decoder.activation_bytes`); for other families, measured: XLA's temporary bytes of the train step
  compiled for one device's rows on the local backend (a topology's: on its
  chip, with its kernels), less the gradients (`compiled.memory_analysis()`;
  the pinned jax reports them on CPU too).
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
import re
from collections.abc import Mapping
from typing import Any

import jax
import pydantic
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

from jax_ai_stack import kernels, topology
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import optim, sharding, step, tasks
from jax_ai_stack.recipes.transforms import Frozen

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
"""What `parse_bytes` accepts: stricter than `pydantic.ByteSize` alone, which reads
"1,5GB" as 1 byte and ignores what follows a unit ("16GB!")."""
_BYTE_SIZE = pydantic.TypeAdapter(pydantic.ByteSize)


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
  """A frozen copy of the base's weights (DPO's reference in full fine-tuning), else 0."""
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
  code: int = 0
  """The compiled program's code, which XLA keeps on every device (4-20 MiB on a TPU):
  known once the step is compiled for the chip (`aot`), else 0, and left out."""

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
            + self.code)

  @property
  def total(self) -> int:
    return self.fixed + self.activations

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
        *([f"  reference    {format_bytes(self.reference):>11}  (frozen copy of the base: "
           "DPO's reference)"] if self.reference else []),
        f"  optimizer    {format_bytes(self.optimizer):>11}",
        f"  gradients    {format_bytes(self.gradients):>11}",
        f"  gathered     {format_bytes(self.gathered):>11}  (weights gathered for the matmuls)",
        f"  activations  {format_bytes(self.activations):>11}  ({self.activations_from})",
        *([f"  code         {format_bytes(self.code):>11}  (XLA's, of the compiled step)"]
          if self.code else []),
        f"  total        {format_bytes(self.total):>11}",
    ]
    if device_memory is None:
      lines.append("device memory unknown (this backend reports none): pass --device-memory, "
                   "e.g. 16GiB, for the largest batch that fits")
    else:
      largest = self.max_batch_size(device_memory)
      fits = "fits" if self.total <= device_memory else "does NOT fit"
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

  def create():
    model = transforms.apply(task.build_model(config.train.seed, plan))
    return model, optim.build_optimizer(config.optim, model, train_steps=config.train.steps,
                                        wrt=transforms.wrt)

  model, optimizer = nnx.eval_shape(create)
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
  analytic = task.activation_bytes(ways, attention)
  if analytic is None:
    per_row, source = _measured_activation_bytes(task, task.training_loss(transforms), model,
                                                 optimizer, batch_size // batch_ways, device)
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
      activations_per_row=per_row, activations_from=source,
      device_memory=target.chip.hbm_bytes if isinstance(target, topology.Topology) else None,
  )


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


def _measured_activation_bytes(task: tasks.Task, loss: step.LossFn, model: nnx.Module,
                               optimizer: nnx.Optimizer, rows: int,
                               device: Any = None) -> tuple[int, str]:
  """XLA's temporary bytes of the one-device train step for `rows` rows, less gradients.

  Compiled for `device` (a topology's compile-only device: its chip's XLA and kernels,
  e.g. a TPU's grouped matmul where this host's CPU would pad experts' rows to blocks),
  or for this host's default device (also where the whole step does not fit one of
  `device`'s chips, which XLA:TPU refuses to compile). Where XLA reports the peak of
  its heap (TPU), the peak less the arguments (the train state) stands for the
  temporary bytes: XLA:TPU's temporaries leave out most of what the backward pass keeps
  (lm-tiny on v5e:2x2, 16 rows a device: 9 MiB of temporaries, a 114 MiB peak). The
  batch's shapes come from the first batch of the train split. Tensor parallelism is
  not taken into account (an overestimate under `fsdp_tp`).
  """
  train_step, _, state = step.make_steps(model, optimizer, loss)
  iterator = iter(task.dataset("train", task.config.train.seed))
  try:
    first = next(iterator)
  finally:
    if hasattr(iterator, "close"):
      iterator.close()  # Stops its prefetch thread now.
  batch = {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype) for k, v in first.items()}
  where = jax.default_backend()
  try:
    if device is not None:
      analysis, where = _compiled_for(device, train_step, state, batch), device.device_kind
  except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a step larger than its HBM.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    device, where = None, f"{where} (the step does not fit one {device.device_kind})"
  if device is None:
    analysis = train_step.lower(state, batch).compile().memory_analysis()
  if analysis is None:
    return 0, f"unknown: XLA reports no memory analysis on {where}"
  gradients = sum(x.size * x.dtype.itemsize
                  for x in jax.tree.leaves(nnx.state(model, optimizer.wrt)))
  peak = getattr(analysis, "peak_memory_in_bytes", 0) if device is not None else 0
  if peak:  # XLA:TPU's temporaries leave out most of what the backward pass keeps.
    measured, what = peak - analysis.argument_size_in_bytes - gradients, "peak heap bytes"
  else:
    measured, what = analysis.temp_size_in_bytes - gradients, "temp bytes"
  return -(-max(measured, 0) // max(rows, 1)), f"measured: XLA {what} of the step on {where}"


def _compiled_for(device: Any, function: Any, *args: Any) -> Any:
  """XLA's memory analysis of `function` compiled for `device` alone, with the kernels
  lowered for its platform (`kernels.compiling_for`, under a one-device mesh of it)."""
  placed = jax.sharding.SingleDeviceSharding(device)
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
  mesh = Mesh([device], ("one",))
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # No client loads these back.
  try:
    with kernels.compiling_for(device.platform), jax.sharding.use_abstract_mesh(
        mesh.abstract_mesh):
      return function.lower(*args).compile().memory_analysis()
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)


def device_memory() -> int | None:
  """Bytes of memory of this process's first device, if the backend says (not CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def parse_bytes(text: str) -> int:
  """'16GiB' -> 17179869184; also GB (powers of 10), MiB, KiB, plain bytes.

  Raises:
    UsageError: not a size.
  """
  match = _SIZE.fullmatch(text)
  try:
    if match:  # "16Gi" too, which ByteSize reads only as "16GiB".
      return int(_BYTE_SIZE.validate_python(f"{match[1]}{match[2] or ''}B"))
  except pydantic.ValidationError:  # Too large for a float.
    pass
  raise UsageError(f"--device-memory {text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB")


def format_bytes(n: int) -> str:
  """Bytes in binary units with three significant digits: '1.50 GiB'."""
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}" if n / size >= 100 else f"{n / size:.2f} {unit}"
  return f"{n} B"


def dry_run(config: Any, *, device_memory_text: str | None = None,
            environ: Mapping[str, str] | None = None,
            autotune_file: str | os.PathLike | None = None) -> str:
  """What `jax-ai-stack train --dry-run` prints: the plan on this host's devices.

  The device memory is `device_memory_text` if given, else what the device
  reports; the attention kernel the one `environ` and `autotune_file` select,
  as for training. Nothing is trained, allocated, or written.
  """
  memory = parse_bytes(device_memory_text) if device_memory_text else device_memory()
  plan = estimate_memory(config, jax.device_count(), environ=environ, autotune_file=autotune_file)
  return f"recipe {config.name} on {jax.device_count()} {jax.default_backend()} device(s)\n" + (
      plan.describe(memory))
