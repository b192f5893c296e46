"""The names of the attention implementations, and parsing an order of them.

This module imports no jax: a recipe config checks `model.attention_impl` when
it loads (`jax-ai-stack train --print-config`), long before anything runs,
and should not pay for jax to do it. What each kernel accepts is `table`'s job.

Example:
  >>> parse("tokamax_xla, xla", origin="model.attention_impl")
  ('tokamax_xla', 'xla')
  >>> parse("flash", origin="model.attention_impl")
  Traceback (most recent call last):
  ...
  jax_ai_stack.kernels.names.UnknownImplementationError: model.attention_impl: unknown attention implementation 'flash'; known: auto, xla, ...
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Sequence
from typing import Literal

from jax_ai_stack.errors import UsageError

AUTO = "auto"
"""In an order, stands for the platform's `PREFERENCE`."""

ImplementationName = Literal[
    "xla", "cudnn", "tokamax_xla", "tokamax_xla_chunked", "xla_blocked", "tokamax_triton",
    "tokamax_mosaic_gpu", "tokamax_mosaic_tpu", "pallas_gpu", "pallas_tpu_flash",
    "pallas_tpu_splash",
]
"""The names of `table.IMPLEMENTATIONS`, in its order (tokamax's `Implementation` style)."""

NAMES: tuple[str, ...] = typing.get_args(ImplementationName)


class UnknownImplementationError(UsageError, ValueError):
  """A name that is not an attention implementation; says where it came from."""


def parse(
    spec: str | Sequence[str], *, origin: str = "implementation", known: Collection[str] = NAMES
) -> tuple[str, ...]:
  """"auto" / "a,b" / ["a", "b"] -> names; the error names `origin` and the bad name.

  Raises:
    UnknownImplementationError (a ValueError): no names, or one not in `known`.
  """
  names = spec.split(",") if isinstance(spec, str) else list(spec)
  names = tuple(n.strip() for n in names if isinstance(n, str) and n.strip())
  if not names:
    raise UnknownImplementationError(f"{origin} {spec!r} names no attention implementation")
  for name in names:
    if name != AUTO and name not in known:
      raise UnknownImplementationError(
          f"{origin}: unknown attention implementation {name!r}; known: {AUTO}, "
          + ", ".join(known)
      )
  return names


def requested(name: str, choices: Sequence[str], why: dict[str, str], kind: str
              ) -> tuple[str, str] | None:
  """For a kernel chosen by name (the MoE grouped matmul, paged attention): None for
  "auto", else (name, "requested: " + its `why`); ValueError naming `choices` for a name
  not among them (`kind` says which kernel)."""
  if name not in (AUTO, *choices):
    raise ValueError(f"unknown {kind} {name!r}; choose auto or one of {', '.join(choices)}")
  return None if name == AUTO else (name, f"requested: {why[name]}")
