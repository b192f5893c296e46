"""Device meshes and logical-axis rules: where every array of a recipe lives.

Models name each dimension of their parameters with a logical axis
(`nnx.with_partitioning`: "embed", "heads", "mlp", "vocab", ...) and each Task
names the dimensions of a batch ("batch", "length", ...). A rule set maps those
names onto the axes of one device mesh, `data x fsdp x expert x tensor`:

* `dp`: the batch is split over every device, parameters are replicated.
* `fsdp`: the batch is split over `data`, `fsdp` and `expert`; parameters and
  optimizer state are split along "embed" over `fsdp` (ZeRO-3 style: XLA
  gathers each weight for its matmul and reduce-scatters its gradient), and a
  mixture-of-experts layer's experts over `expert` (expert parallelism: each
  device runs its own experts on the tokens routed to them, `models.moe`).
* `fsdp_tp`: as `fsdp`, plus heads, MLP and vocabulary dimensions split over
  `tensor` (Megatron-style tensor parallelism).

The sizes decide how much each rule does: with `tensor: 1` the `fsdp_tp` rules
are `fsdp`, and on one device every rule set is a single-device program.

The mesh's axes are `AxisType.Auto` on purpose: `jax.make_mesh` defaults to
`Explicit` axes in the pinned jax, under which every einsum without an output
sharding raises `ShardingTypeError`; with `Auto` axes XLA's SPMD partitioner
propagates the shardings of the inputs, and a few constraints suffice.

Those constraints are the model's: on several devices the trainer hands it a
`Layout` (the mesh and the rules), with which it pins its hidden states and
tells attention where q, k, v live (`kernels.AttentionSharding`).

Example:
  >>> config = MeshConfig(data=1, fsdp=-1, rules="fsdp")
  >>> mesh_shape(config, device_count=8)
  {'data': 1, 'fsdp': 8, 'expert': 1, 'tensor': 1}
  >>> logical_rules(config)["embed"]
  ('fsdp',)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.kernels.sharded import AttentionSharding
from jax_ai_stack.recipes.sharding_config import MESH_AXES, MeshConfig

Rules = Mapping[str, tuple[str, ...]]

_BATCH = {"batch": ("data", "fsdp", "expert")}
RULE_SETS: Mapping[str, Rules] = {
    "dp": _BATCH,
    "fsdp": {**_BATCH, "embed": ("fsdp",), "experts": ("expert",)},
    "fsdp_tp": {
        **_BATCH, "embed": ("fsdp",), "experts": ("expert",),
        "heads": ("tensor",), "kv_heads": ("tensor",),
        "mlp": ("tensor",), "vocab": ("tensor",), "classes": ("tensor",),
    },
}
"""Logical axis -> mesh axes, per named rule set. Unnamed axes are replicated."""


def mesh_shape(config: MeshConfig, device_count: int) -> dict[str, int]:
  """Each mesh axis's size, with -1 resolved; ConfigError if they do not fit."""
  sizes = {axis: getattr(config, axis) for axis in MESH_AXES}
  known = math.prod(size for size in sizes.values() if size != -1)
  for axis, size in sizes.items():
    if size == -1:
      if device_count % known:
        raise ConfigError(_describe(sizes) + f" cannot fill {device_count} devices: "
                          f"{device_count} is not a multiple of {known}")
      sizes[axis] = device_count // known
  if math.prod(sizes.values()) != device_count:
    raise ConfigError(_describe(sizes) + f" = {math.prod(sizes.values())} devices, but there "
                      f"are {device_count}; make the sizes multiply to {device_count} "
                      "(one of them may be -1)")
  return sizes


def _describe(sizes: Mapping[str, int]) -> str:
  return " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The `data x fsdp x expert x tensor` mesh over `devices` (default: all), Auto axes."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config, len(devices))
  return jax.make_mesh(tuple(shape.values()), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def logical_rules(config: MeshConfig) -> dict[str, tuple[str, ...]]:
  """The rule set named by `config.rules` with `config.rule_overrides` applied."""
  rules = dict(RULE_SETS[config.rules])
  rules.update({name: tuple(axes) for name, axes in config.rule_overrides.items()})
  return rules


def partition_spec(names: Sequence[str | None], shape: Sequence[int], rules: Rules,
                   mesh: jax.sharding.Mesh, *, what: str) -> PartitionSpec:
  """The PartitionSpec of an array whose dimensions have logical `names`.

  Raises:
    ConfigError: a dimension does not divide by its mesh axes, or two
      dimensions map to one mesh axis; names `what`, its shape and the axis.
  """
  used: dict[str, str] = {}
  spec = []
  for dim, (name, size) in enumerate(zip(names, shape)):
    axes = tuple(rules.get(name, ())) if name else ()
    for axis in axes:
      if axis in used:
        raise ConfigError(f"{what}: logical axes {used[axis]!r} and {name!r} both map to mesh "
                          f"axis {axis!r}; change mesh.rules or mesh.rule_overrides")
      used[axis] = name
    ways = math.prod(mesh.shape[axis] for axis in axes)
    if size % ways:
      also = ", or model.vocab_multiple (the rows are padded to it)" if name == "vocab" else ""
      raise ConfigError(
          f"{what} has shape {tuple(shape)}: dimension {dim} ({name!r}, size {size}) does not "
          f"divide by mesh axes {' x '.join(axes)} of size {ways}; change the mesh sizes or "
          f"mesh.rule_overrides.{name}{also}")
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def state_shardings(abstract_state: Any, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
  """A NamedSharding for every Variable of an (abstract) nnx state.

  Each Variable's logical names are its `out_sharding` metadata (set by
  `nnx.with_partitioning`); optimizer state inherits them from its parameter,
  so it is split like the parameter. Variables without names are replicated.
  """

  def sharding(path, variable):
    if not isinstance(variable, nnx.Variable):
      return NamedSharding(mesh, PartitionSpec())
    value = variable.get_value()
    names = variable.get_metadata().get("out_sharding") or ()
    what = "parameter " + jax.tree_util.keystr(path, simple=True, separator="/")
    return variable.replace(
        NamedSharding(mesh, partition_spec(names, value.shape, rules, mesh, what=what)))

  return jax.tree_util.tree_map_with_path(
      sharding, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_shardings(batch_axes: Mapping[str, Sequence[str | None]], shapes: Mapping[str, Sequence[int]],
                    mesh: jax.sharding.Mesh, rules: Rules) -> dict[str, NamedSharding]:
  """A NamedSharding per batch entry, from the Task's logical batch axes.

  `shapes` are global shapes; an entry the Task does not name is split on its
  first dimension like "batch".
  """
  out = {}
  for key, shape in shapes.items():
    names = tuple(batch_axes.get(key, ("batch",)))
    names = names + (None,) * (len(shape) - len(names))
    spec = partition_spec(names, shape, rules, mesh,
                          what=f"the global batch's {key!r} (data.batch_size={shape[0]} rows)")
    out[key] = NamedSharding(mesh, spec)
  return out


def global_batch(local: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding],
                 global_rows: int) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global arrays laid out by `shardings`.

  Every process passes its own contiguous share (`data.batch_size //
  process_count` rows, in process order); the result is one array per entry
  whose first dimension is `global_rows`.
  """
  return {
      key: jax.make_array_from_process_local_data(
          shardings[key], value, (global_rows, *value.shape[1:]))
      for key, value in local.items()
  }


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh and its rules as a model sees them: where its activations go.

  Hashable, so a model holds it as static structure. `Placement.layout()`
  gives one only for a mesh of several devices; without one a model traces
  exactly its single-device program.

  Example:
    >>> mesh = jax.sharding.AbstractMesh((2, 1, 1, 2), MESH_AXES)
    >>> layout = Layout.of(mesh, logical_rules(MeshConfig(rules="fsdp_tp")))
    >>> layout.spec(("batch", "length", None), (8, 16, 32))
    P(('data', 'fsdp', 'expert'), None, None)
    >>> layout.spec(("batch", "length", None), (1, 16, 32))  # One prompt: replicated.
    P(None, None, None)
    >>> layout.attention().heads
    ('tensor',)
  """

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  rules: tuple[tuple[str, tuple[str, ...]], ...]
  """The logical rules as sorted (name, mesh axes) pairs (a dict is not hashable)."""

  @classmethod
  def of(cls, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, rules: Rules) -> Layout:
    return cls(mesh, tuple(sorted((name, tuple(axes)) for name, axes in rules.items())))

  def spec(self, names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """As `partition_spec`, but a dimension that does not divide is replicated.

    Activations take whatever batch they are given (one prompt decoded on an
    8-way data mesh), unlike parameters and training batches, which must divide.
    """
    rules = dict(self.rules)
    fits = lambda name, size: size % math.prod(self.mesh.shape[a] for a in rules.get(name, ())) == 0
    names = [name if name and fits(name, size) else None for name, size in zip(names, shape)]
    return partition_spec(names, shape, rules, self.mesh, what=f"an activation {tuple(shape)}")

  def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` pinned where its logical `names` say, so that XLA does not guess."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(names, x.shape)))

  def attention(self) -> AttentionSharding:
    """Where q, k, v [B, T, N, H] live: batch as "batch", all heads as "heads".

    Key/value heads follow the query heads' axes (not "kv_heads"), so that a
    kernel run per shard pairs each query head with its own K/V head.
    """
    rules = dict(self.rules)
    return AttentionSharding(self.mesh, batch=rules.get("batch", ()), heads=rules.get("heads", ()))


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one run's arrays live: its mesh, its rules and the Task's batch axes.

  The trainer builds one per run and asks it for the state's shardings and
  for each batch as global arrays.
  """

  mesh: jax.sharding.Mesh
  rules: Rules
  batch_axes: Mapping[str, Sequence[str | None]]

  @classmethod
  def build(cls, config: MeshConfig, batch_axes: Mapping[str, Sequence[str | None]]) -> Placement:
    return cls(build_mesh(config), logical_rules(config), batch_axes)

  def state_shardings(self, abstract_state: Any) -> Any:
    return state_shardings(abstract_state, self.mesh, self.rules)

  def check_rows(self, sizes: Sequence[tuple[str, int]]) -> None:
    """Raises ConfigError, naming the field, for the first (field, global rows) of `sizes`
    whose rows do not split over the mesh axes a batch's rows are laid out on."""
    names = next(iter(self.batch_axes.values()), ("batch",))[:1]
    for field, rows in sizes:
      partition_spec(names, (rows,), self.rules, self.mesh, what=f"{field}={rows}: the batch")

  def layout(self) -> Layout | None:
    """What the model needs to place its activations; None on one device."""
    return Layout.of(self.mesh, self.rules) if self.mesh.size > 1 else None

  def batch(self, local: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows (from the data pipeline) as one global batch."""
    rows = len(next(iter(local.values()))) * jax.process_count()
    shapes = {key: (rows, *value.shape[1:]) for key, value in local.items()}
    return global_batch(local, batch_shardings(self.batch_axes, shapes, self.mesh, self.rules), rows)

  def describe(self) -> str:
    return " x ".join(f"{axis} {size}" for axis, size in self.mesh.shape.items()) + " mesh"


def on_one_device(model: nnx.Module, device: jax.Device) -> nnx.Module:
  """A copy of `model` with every value whole on `device` and no mesh in it (each module's
  `Layout` and `AttentionSharding` attributes None: no constraints, nothing run per shard):
  the program one device runs alone, as a process decoding its own rows does (`rl.rollout`,
  `evaluation.in_training`). A value sharded over several processes is gathered, so every
  process must call this together."""
  def whole(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = multihost_utils.process_allgather(x, tiled=True)
    return jax.device_put(x, device)

  graphdef, state = nnx.split(model)
  return without_mesh(nnx.merge(graphdef, jax.tree.map(whole, state)))


def without_mesh(model: nnx.Module) -> nnx.Module:
  """`model` with each module's `Layout` and `AttentionSharding` attributes None (in place):
  its programs then lay nothing out on a mesh."""
  for _, module in nnx.iter_modules(model):
    for name, value in list(vars(module).items()):
      if isinstance(value, (Layout, AttentionSharding)):
        setattr(module, name, None)
  return model


def on_this_process(model: nnx.Module) -> nnx.Module:
  """`model` itself on one process; on several, `on_one_device(model)` on this process's
  first device, for it to compute alone (every process must call this together)."""
  if jax.process_count() == 1:
    return model
  return on_one_device(model, jax.local_devices()[0])
