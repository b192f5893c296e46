"""The grouped matmul of mixture-of-experts layers, chosen per backend.

`grouped_matmul(lhs, rhs, group_sizes)` multiplies consecutive row groups of
lhs [M, K] (the tokens sorted by expert, `group_sizes[g]` rows for expert g)
by their expert's rhs[g] [K, N]; rows past the groups' sum give zeros. It has
the API of `jax.lax.ragged_dot`. Implementations, in the order "auto" tries:

  tokamax  `tokamax.ragged_dot`: tokamax picks Mosaic (TPU, Hopper GPUs), Triton (GPU)
           or XLA (CPU) itself, falling back along that order
  xla      `jax.lax.ragged_dot`
  dense    every expert on every row, masked to its group: G times the FLOPs; the
           reference the others are tested against, never chosen by "auto"

`choose_grouped_matmul(requested)` returns the implementation that runs and why (what
`jax-ai-stack kernels` reports and a MoE model is built with).

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

__all__ = ["GROUPED_MATMULS", "choose_grouped_matmul", "grouped_matmul"]

GROUPED_MATMULS = ("tokamax", "xla", "dense")
_WHY = {"tokamax": "tokamax.ragged_dot, which picks Mosaic, Triton or XLA itself",
        "xla": "jax.lax.ragged_dot", "dense": "every expert on every row: the reference"}


def choose_grouped_matmul(requested: str = "auto") -> tuple[str, str]:
  """(implementation, why) for `requested` ("auto" or one of `GROUPED_MATMULS`).

  Raises ValueError naming the implementations for an unknown name.
  """
  if requested not in ("auto", *GROUPED_MATMULS):
    raise ValueError(f"unknown grouped matmul {requested!r}; choose auto or one of "
                     f"{', '.join(GROUPED_MATMULS)}")
  if requested != "auto":
    return requested, f"requested: {_WHY[requested]}"
  if importlib.util.find_spec("tokamax") is not None:
    return "tokamax", f"auto: {_WHY['tokamax']}"
  return "xla", f"auto: tokamax is not installed; {_WHY['xla']}"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto",
                   preferred_element_type=None) -> jax.Array:
  """[M, N]: row block g of `lhs` [M, K] times `rhs[g]` [K, N] (`jax.lax.ragged_dot`)."""
  name, _ = choose_grouped_matmul(implementation)
  if name == "tokamax":
    from jax_ai_stack.kernels.implementations import import_tokamax  # pylint: disable=g-import-not-at-top

    return import_tokamax().ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=preferred_element_type)
  if name == "xla":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=preferred_element_type)
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # G past the end.
  every = jnp.einsum("mk,gkn->gmn", lhs, rhs, preferred_element_type=preferred_element_type)
  mask = group[None, :] == jnp.arange(rhs.shape[0])[:, None]
  return jnp.where(mask[..., None], every, 0).sum(axis=0).astype(every.dtype)
