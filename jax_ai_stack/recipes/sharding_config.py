"""`MeshConfig`: the `mesh` section of a recipe, and the mesh's axis names.

Kept out of `sharding` (which imports jax) so that a recipe config loads and
prints without it; `sharding` re-exports both.

Example:
  >>> MeshConfig(fsdp=-1, data=1).rules
  'fsdp'
  >>> MeshConfig(fsdp=-1, tensor=2).data  # An explicit -1 wins over the default's.
  1
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pydantic
import pydantic_core

from jax_ai_stack.recipes.configlib import config_dataclass

MESH_AXES = ("data", "fsdp", "tensor")
"""The mesh's axis names, outermost first (data parallelism crosses hosts)."""

REST = -1
"""A mesh size meaning "the devices the other axes leave"; at most one axis has it."""


def prefer_explicit_rest(mesh: dict, explicit: set[str]) -> dict:
  """`mesh` with an earlier layer's -1 yielding to the one in `explicit` (a later layer's).

  A config is layered (defaults, preset, `--config` file, overrides), and only
  one mesh axis may be -1 (the rest). When the later layer sets exactly one
  axis to -1, an axis it did not set that an earlier layer left at -1 becomes
  1: `mesh.fsdp=-1` over the default `data: -1` means FSDP over every device.
  Two -1s set by the same layer stay, for `MeshConfig` to refuse.

  Args:
    mesh: the merged `mesh` section (a plain dict).
    explicit: the axes the later layer set.

  Returns:
    A new dict.

  Example:
    >>> prefer_explicit_rest({"data": -1, "fsdp": -1, "tensor": 2}, {"fsdp", "tensor"})
    {'data': 1, 'fsdp': -1, 'tensor': 2}
  """
  claimed = [a for a in MESH_AXES if a in explicit and mesh.get(a) == REST]
  if len(claimed) != 1:
    return dict(mesh)
  return {k: (1 if k in MESH_AXES and k not in explicit and v == REST else v)
          for k, v in mesh.items()}


@config_dataclass
class MeshConfig:
  """The device mesh of a run and the rules that place arrays on it.

  Sizes multiply to the number of devices; one of them may be -1 (the rest).
  The default, `data: -1`, is plain data parallelism over every device; on one
  device it is the single-device program.
  """

  data: int = -1
  """Data-parallel replicas (the outermost axis: it may cross hosts)."""
  fsdp: int = 1
  """Devices that split parameters, gradients and optimizer state (and the batch)."""
  tensor: int = 1
  """Devices that split heads, MLP and vocabulary dimensions (tensor parallelism)."""
  rules: Literal["dp", "fsdp", "fsdp_tp"] = "fsdp"
  """Which logical-axis rule set maps the model's axis names onto the mesh."""
  rule_overrides: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  """Per logical axis, mesh axes replacing the rule set's ([] replicates), e.g.
  {vocab: [tensor], mlp: []}."""

  @pydantic.model_validator(mode="before")
  @classmethod
  def _explicit_rest_wins(cls, data: Any) -> Any:
    """`fsdp` or `tensor` given as -1 takes the rest from `data`'s default -1."""
    if isinstance(data, pydantic_core.ArgsKwargs):
      kwargs = data.kwargs or {}
      if "data" not in kwargs and REST in (kwargs.get("fsdp"), kwargs.get("tensor")):
        return pydantic_core.ArgsKwargs(data.args, {**kwargs, "data": 1})
    elif isinstance(data, dict):
      if "data" not in data and REST in (data.get("fsdp"), data.get("tensor")):
        return {**data, "data": 1}
    return data

  def __post_init__(self):
    sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
    for axis, size in sizes.items():
      if size == 0 or size < -1:
        raise ValueError(f"mesh.{axis} must be >= 1 or -1 (the rest), got {size}")
    if list(sizes.values()).count(-1) > 1:
      raise ValueError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    for name, axes in self.rule_overrides.items():
      unknown = [a for a in axes if a not in MESH_AXES]
      if unknown:
        raise ValueError(f"mesh.rule_overrides.{name}: unknown mesh axis {unknown[0]!r}; "
                         f"axes: {', '.join(MESH_AXES)}")
