"""The mesh's axis names and the rule for layered -1 sizes: plain Python, below `configlib`.

`configlib.apply_overrides` needs `prefer_explicit_rest` and `sharding_config`
(which builds on `configlib`) the names; both import them from here.

Example:
  >>> MESH_AXES, REST
  (('data', 'fsdp', 'expert', 'tensor'), -1)
"""

from __future__ import annotations

MESH_AXES = ("data", "fsdp", "expert", "tensor")
"""The mesh's axis names, outermost first (data parallelism crosses hosts; tensor
parallelism, the most talkative, innermost; the experts' token exchange next to it)."""

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
