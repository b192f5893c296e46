"""Attention under a mesh: opaque kernels run on each device's shard.

XLA's SPMD partitioner splits the plain-XLA kernels (`xla`, `tokamax_xla`,
`tokamax_xla_chunked`) like any other ops. Every other kernel (Pallas, tokamax
Triton/Mosaic, cuDNN) is a custom call the partitioner cannot look into: it
would gather q, k, v whole onto every device, or fail. `per_shard` runs such a
kernel inside `jax.shard_map` instead, with the batch split over the mesh axes
of `AttentionSharding.batch` and the heads over those of `.heads`, so each
device calls the kernel on its local [B/b, T, N/h, H] and [B/b, S, K/h, H].

Heads are split in contiguous blocks, query and key/value heads alike, so local
query head n still reads local K/V head n // (N/K): grouped-query attention
stays exact when both N and K divide by the heads axes' size, and
`AttentionShardingError` says so otherwise. A batch that does not divide by
the batch axes (one prompt decoded on a data-parallel mesh) is not split:
every device then runs the kernel on all of it.

The caller says where q, k, v live (the model builds an `AttentionSharding`
from its mesh and logical rules); nothing is read from an ambient mesh.

Example:
  >>> mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
  >>> AttentionSharding(mesh, batch=("data",), heads=("tensor",)).qkv_spec(batch=4)
  P('data', None, 'tensor', None)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.kernels.request import Request


class AttentionShardingError(ConfigError):
  """The attention heads do not divide by the mesh axes that split them."""


def _axes(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
  """One entry of a PartitionSpec: None, an axis name, or several."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class AttentionSharding:
  """Where q, k, v live on a mesh: their batch over `batch`, their heads over `heads`.

  Hashable, so a model can hold it as static structure.
  """

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  batch: tuple[str, ...] = ()
  """Mesh axes that split the batch dimension (e.g. ("data", "fsdp"))."""
  heads: tuple[str, ...] = ()
  """Mesh axes that split query and key/value heads alike (e.g. ("tensor",))."""

  def __post_init__(self):
    object.__setattr__(self, "batch", tuple(self.batch))
    object.__setattr__(self, "heads", tuple(self.heads))
    for axis in self.batch + self.heads:
      if axis not in self.mesh.axis_names:
        raise ValueError(f"mesh axis {axis!r} is not one of {self.mesh.axis_names}")
    if shared := set(self.batch) & set(self.heads):
      raise ValueError(f"mesh axes {sorted(shared)} cannot split both batch and heads")

  def size(self, axes: tuple[str, ...]) -> int:
    return math.prod(self.mesh.shape[axis] for axis in axes)

  def qkv_spec(self, *, batch: int) -> PartitionSpec:
    """The spec of q, k and v [B, T, N, H] for a batch of `batch` rows."""
    rows = self.batch if batch % self.size(self.batch) == 0 else ()
    return PartitionSpec(_axes(rows), None, _axes(self.heads), None)


def per_shard(fn: Callable[..., jax.Array], sharding: AttentionSharding | None,
              request: Request, *, name: str) -> Callable[..., jax.Array]:
  """`fn(q, k, v, segment_ids, kv_seq_lengths, sinks=None)` run on local shards
  (`jax.shard_map`), `sinks` [N] split with the heads.

  `fn` itself when there is no sharding or the mesh has one device, so a
  single-device program is exactly what it was. `name` is the kernel's, for
  the error.

  Raises:
    AttentionShardingError: num_heads or num_kv_heads does not divide by the
      heads axes' size.
  """
  if sharding is None or sharding.mesh.size == 1:
    return fn
  ways = sharding.size(sharding.heads)
  if request.num_heads % ways or request.num_kv_heads % ways:
    raise AttentionShardingError(
        f"{name} runs on each device's shard of the heads, and num_heads {request.num_heads} "
        f"and num_kv_heads {request.num_kv_heads} must both divide by the {ways} devices of "
        f"mesh axes {'x'.join(sharding.heads)}; change the mesh sizes or the heads, or use an "
        "attention implementation XLA partitions itself (xla, tokamax_xla)")
  qkv = sharding.qkv_spec(batch=request.batch)
  rows = PartitionSpec(qkv[0])
  # check_vma=False: opaque kernels (pallas_call, tokamax's custom VJPs) have
  # no replication rules; every output dimension is split as its spec says.
  local = jax.shard_map(
      lambda q, k, v, ids, lengths, sinks: fn(q, k, v, ids, lengths, sinks=sinks),
      mesh=sharding.mesh,
      in_specs=(qkv, qkv, qkv, PartitionSpec(qkv[0], None), rows, PartitionSpec(qkv[2])),
      out_specs=qkv, check_vma=False,
  )
  return lambda q, k, v, ids, lengths, sinks=None: local(q, k, v, ids, lengths, sinks)
