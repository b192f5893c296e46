"""`MeshConfig`: the `mesh` section of a recipe, and the mesh's axis names.

Kept out of `sharding` (which imports jax) so that a recipe config loads and
prints without it; `sharding` re-exports both. The axis names themselves live
in `mesh_axes`, below `configlib` (whose overrides need them).

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
from jax_ai_stack.recipes.mesh_axes import (  # noqa: F401  (re-exported)
    MESH_AXES, REST, prefer_explicit_rest)


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
  expert: int = 1
  """Devices that split a mixture-of-experts layer's experts (expert parallelism), and the
  batch like `data` elsewhere; must divide `model.moe.num_experts`."""
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
    """Another axis given as -1 takes the rest from `data`'s default -1."""
    others = [axis for axis in MESH_AXES if axis != "data"]
    if isinstance(data, pydantic_core.ArgsKwargs):
      kwargs = data.kwargs or {}
      if "data" not in kwargs and REST in [kwargs.get(axis) for axis in others]:
        return pydantic_core.ArgsKwargs(data.args, {**kwargs, "data": 1})
    elif isinstance(data, dict):
      if "data" not in data and REST in [data.get(axis) for axis in others]:
        return {**data, "data": 1}
    return data

  def __post_init__(self):
    sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
    for axis, size in sizes.items():
      if size == 0 or size < -1:
        raise ValueError(f"mesh.{axis} must be >= 1 or -1 (the rest), got {size}")
    if list(sizes.values()).count(-1) > 1:
      raise ValueError("at most one of " + ", ".join(f"mesh.{a}" for a in MESH_AXES)
                       + " may be -1")
    for name, axes in self.rule_overrides.items():
      unknown = [a for a in axes if a not in MESH_AXES]
      if unknown:
        raise ValueError(f"mesh.rule_overrides.{name}: unknown mesh axis {unknown[0]!r}; "
                         f"axes: {', '.join(MESH_AXES)}")
