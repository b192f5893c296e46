"""The grouped matmul of mixture-of-experts layers, chosen per backend.

`grouped_matmul(lhs, rhs, group_sizes)` multiplies consecutive row groups of
lhs [M, K] (the tokens sorted by expert, `group_sizes[g]` rows for expert g)
by their expert's rhs[g] [K, N]; rows past the groups' sum give zeros. It has
the API of `jax.lax.ragged_dot`. Implementations ("auto": blocked on CPU,
tokamax_mosaic_tpu on TPU, else tokamax):

  tokamax  `tokamax.ragged_dot`: tokamax picks Mosaic (Hopper GPUs), Triton (GPU)
           or XLA itself, falling back along that order
  tokamax_mosaic_tpu
           `tokamax.ragged_dot(implementation="mosaic_tpu")`, MegaBlocks' grouped matmul
           in Mosaic: what "tokamax" becomes on TPU. Named, because tokamax resolves
           its "mosaic" by the host's device, not the devices a program is compiled
           for. The kernel takes M, K and N of at least 128 (`mosaic_tpu_refusal`);
           smaller calls (a decoding step's few rows) run xla
  xla      `jax.lax.ragged_dot`
  blocked  each group's rows padded to whole blocks and one batched matmul over the
           blocks (MegaBlocks' layout): XLA:CPU's ragged_dot costs about every group on
           every row, this about the rows' own FLOPs plus the padding
  dense    every expert on every row, masked to its group: G times the FLOPs; the
           reference the others are tested against, never chosen by "auto"

`choose_grouped_matmul(requested, platform, shapes=...)` returns the implementation that
runs and why (what `jax-ai-stack kernels` reports and a MoE model is built with).

Example:
  >>> import jax.numpy as jnp
  >>> lhs, rhs = jnp.ones((3, 2)), jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
  >>> grouped_matmul(lhs, rhs, jnp.array([1, 2]), implementation="xla").tolist()
  [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
  >>> choose_grouped_matmul("dense")
  ('dense', 'requested: every expert on every row: the reference')
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import names, rules
from jax_ai_stack.kernels.request import Backend, target_backend

__all__ = ["GROUPED_MATMULS", "choose_grouped_matmul", "grouped_matmul"]

GROUPED_MATMULS = ("tokamax", "tokamax_mosaic_tpu", "xla", "blocked", "dense")
MOSAIC_TPU_MIN = 128
"""tokamax's Mosaic TPU ragged_dot refuses a call whose M, K or N is smaller."""
_WHY = {"tokamax": "tokamax.ragged_dot, which picks Mosaic, Triton or XLA itself",
        "tokamax_mosaic_tpu": "tokamax.ragged_dot's Mosaic TPU kernel, named (tokamax "
                              "resolves 'mosaic' by the host's device)",
        "xla": "jax.lax.ragged_dot",
        "blocked": "each expert's rows padded to blocks, one batched matmul over the blocks",
        "dense": "every expert on every row: the reference"}


def choose_grouped_matmul(requested: str = "auto", platform: str | None = None,
                          device_kind: str | None = None, *,
                          shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
                          ) -> tuple[str, str]:
  """(implementation, why) for `requested` ("auto" or one of `GROUPED_MATMULS`) on
  `platform` (None: JAX's default backend) and `device_kind`. "auto": `blocked` on CPU,
  else tokamax where installed, else xla; tokamax on TPU is `tokamax_mosaic_tpu`, which
  gives way to xla for TPUs before v5 and for `shapes` (lhs [M, K], rhs [G, K, N]) it
  does not take, and to the platform's "auto" off a TPU.

  Raises ValueError naming the implementations for an unknown name.
  """
  chosen = names.requested(requested, GROUPED_MATMULS, _WHY, "grouped matmul")
  platform = platform or jax.default_backend()
  if chosen is not None:
    name, why = chosen
  elif platform == "cpu":
    return "blocked", (f"auto on cpu: {_WHY['blocked']} (XLA:CPU's ragged_dot costs about "
                       "every group on every row: benchmarks/moe.py)")
  elif importlib.util.find_spec("tokamax") is None:
    return "xla", f"auto on {platform}: tokamax is not installed; {_WHY['xla']}"
  elif platform == "tpu":
    name, why = "tokamax_mosaic_tpu", f"auto on tpu: {_WHY['tokamax_mosaic_tpu']}"
  else:
    name, why = "tokamax", f"auto on {platform}: {_WHY['tokamax']}"
  if name == "tokamax" and platform == "tpu":
    name, why = "tokamax_mosaic_tpu", f"{why}; on tpu: {_WHY['tokamax_mosaic_tpu']}"
  if name != "tokamax_mosaic_tpu":
    return name, why
  if platform != "tpu":  # A TPU model's step compiled on this host (the memory plan's).
    fallback, because = choose_grouped_matmul("auto", platform, device_kind, shapes=shapes)
    return fallback, f"{why}; it runs on TPUs only, not {platform}: {because}"
  generation = rules.tpu_generation(Backend(platform, device_kind or ""))
  if platform == "tpu" and generation is not None and generation < 5:
    return "xla", (f"{why}; it needs TPU v5 or newer (device: {device_kind}): "
                   f"{_WHY['xla']}")
  if shapes is not None and (reason := mosaic_tpu_refusal(*shapes)):
    return "xla", f"{why}; {reason}: {_WHY['xla']}"
  return name, why


def mosaic_tpu_refusal(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> str | None:
  """Why tokamax's Mosaic TPU ragged_dot refuses lhs [M, K] and rhs [G, K, N] (it raises
  NotImplementedError as it traces), or None."""
  if min(*lhs_shape[-2:], *rhs_shape[-2:]) < MOSAIC_TPU_MIN:
    return (f"its Mosaic TPU kernel takes M, K, N >= {MOSAIC_TPU_MIN}, not lhs "
            f"{list(lhs_shape)} and rhs {list(rhs_shape)}")
  return None


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto",
                   preferred_element_type=None) -> jax.Array:
  """[M, N]: row block g of `lhs` [M, K] times `rhs[g]` [K, N] (`jax.lax.ragged_dot`),
  chosen for the devices it is compiled for (a chip this machine lacks, too)."""
  target = target_backend()
  name, _ = choose_grouped_matmul(implementation, target.platform, target.device_kind,
                                  shapes=(lhs.shape, rhs.shape))
  if name == "tokamax" and _compiling_for_a_gpu_elsewhere():
    # tokamax's GPU kernels read this host's device (Mosaic GPU: "Unsupported GPU
    # architecture"; Triton needs jax_triton), so a compile-only GPU gets XLA's ragged_dot.
    name = "xla"
  if name in ("tokamax", "tokamax_mosaic_tpu"):
    from jax_ai_stack.kernels.implementations import import_tokamax  # pylint: disable=g-import-not-at-top

    named = {"implementation": "mosaic_tpu"} if name == "tokamax_mosaic_tpu" else {}
    grouped = (jnp.arange(lhs.shape[0]) < group_sizes.sum())[:, None]
    # Rows past the groups: zeros, as promised, and zero gradients. The kernels skip those
    # rows forward and backward (tokamax's Mosaic TPU kernel leaves its lhs gradient
    # there unwritten: NaN in interpret mode).
    out = import_tokamax().ragged_dot(_zero_gradient_where(lhs, ~grouped), rhs, group_sizes,
                                      preferred_element_type=preferred_element_type, **named)
    return jnp.where(grouped, out, 0)
  if name == "xla":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=preferred_element_type)
  if name == "blocked":
    return _blocked(lhs, rhs, group_sizes, preferred_element_type)
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # G past the end.
  every = jnp.einsum("mk,gkn->gmn", lhs, rhs, preferred_element_type=preferred_element_type)
  mask = group[None, :] == jnp.arange(rhs.shape[0])[:, None]
  return jnp.where(mask[..., None], every, 0).sum(axis=0).astype(every.dtype)


def _compiling_for_a_gpu_elsewhere() -> bool:
  """Whether the call is traced for a GPU this host does not have (a compile-only device's
  abstract mesh, `jax_ai_stack.topology`)."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return (device is not None and device.platform == "gpu"
          and jax.devices()[0].platform != "gpu")


@jax.custom_vjp
def _zero_gradient_where(x: jax.Array, where: jax.Array) -> jax.Array:
  """`x` itself (no copy for a kernel to read), whose gradient is zero where `where`."""
  del where
  return x


def _zero_gradient_forward(x, where):
  return x, where


def _zero_gradient_backward(where, cotangent):
  return jnp.where(where, 0, cotangent).astype(cotangent.dtype), None


_zero_gradient_where.defvjp(_zero_gradient_forward, _zero_gradient_backward)


def block_rows(rows: int, groups: int) -> int:
  """Rows per block of `_blocked`: a power of two near rows / (4 groups), from 8 to 128,
  so that padding each group to whole blocks adds about a quarter at most."""
  target = max(rows // (4 * groups), 1)
  return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def _blocked(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
             preferred_element_type) -> jax.Array:
  """Each group's rows padded to whole blocks, one batched matmul over the blocks, each
  block against its group's weight (MegaBlocks' layout): about the FLOPs of the rows,
  where XLA:CPU's ragged_dot pays for every group on every row."""
  rows, groups = lhs.shape[0], rhs.shape[0]
  block = block_rows(rows, groups)
  blocks = -(-(rows + groups * (block - 1)) // block)
  sizes = group_sizes.astype(jnp.int32)
  padded = -(-sizes // block) * block
  starts, padded_starts = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
  group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right")  # groups: none.
  valid = group < groups
  group = jnp.minimum(group, groups - 1)
  slot = jnp.where(valid, padded_starts[group] + jnp.arange(rows) - starts[group], blocks * block)
  x = jnp.zeros((blocks * block, lhs.shape[1]), lhs.dtype).at[slot].set(lhs, mode="drop")
  owner = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * block, side="right")
  weights = rhs[jnp.minimum(owner, groups - 1)]  # [blocks, K, N]; blocks past the end: zeros.
  y = jnp.einsum("bmk,bkn->bmn", x.reshape(blocks, block, -1), weights,
                 preferred_element_type=preferred_element_type)
  y = y.reshape(blocks * block, -1)
  return jnp.where(valid[:, None], y[jnp.minimum(slot, blocks * block - 1)], 0).astype(y.dtype)
