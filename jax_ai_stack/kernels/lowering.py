"""Which kernel a chip's compiler takes: the chosen one compiled alone for a device of
that chip, and, while the compiler refuses it, the next one, with the refusal as reason.

Selection (`table`, `rules`, `choose_grouped_matmul`, `choose_paged_attention`) knows
what a kernel accepts; only the chip's compiler knows what fits its memories: JAX's
ragged paged-attention kernel at 128 pages a row asks a v5e for more scoped VMEM than
it has, say, which no rule of ours states. A device may be a compile-only one
(`jax_ai_stack.topology`): each kernel is compiled forward (and backward, where it
trains) at the call's shapes, as `train --dry-run --topology` compiles the attention
kernel of its step, so what a run would fall back to on the chip is known without one.

Example: (the compiles need libtpu; tests/test_kernels_tpu.py runs them)
  >>> from jax_ai_stack import topology
  >>> chip = topology.load("v5e:2x2").devices[0]  # doctest: +SKIP
  >>> grouped_matmul_that_compiles("auto", chip, (16, 128), (8, 128, 192))  # doctest: +SKIP
  Lowered(name='xla', why="auto on tpu: ...; its Mosaic TPU kernel takes M, K, N >= 128, ...
  >>> Lowered("xla", "the only one").refused  # Nothing refused before it.
  ()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import experts, implementations, paged, paged_tpu
from jax_ai_stack.kernels.attention import attention
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.selection import NoImplementationError
from jax_ai_stack.kernels.request import Request, backend_of

__all__ = ["Lowered", "attention_compile_error", "attention_that_compiles", "compile_error",
           "grouped_matmul_that_compiles", "no_persistent_cache", "paged_attention_that_compiles"]


class Lowered(NamedTuple):
  """The kernel that compiles, why it was chosen, and 'name: why' of each refused before."""

  name: str
  why: str
  refused: tuple[str, ...] = ()


def compile_error(function: Callable[..., Any], args: tuple[Any, ...], device: Any) -> str | None:
  """The first line of why `device`'s compiler refuses `jax.jit(function)` at `args`
  (`jax.ShapeDtypeStruct`s), or None. Traced inside `compiling_for` the device's platform
  and an abstract mesh of the device, whose kind Mosaic kernels read as their target's."""
  mesh = jax.sharding.Mesh([device], ("one",))
  placed = jax.sharding.SingleDeviceSharding(device)
  args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args)
  try:
    with (no_persistent_cache(), implementations.compiling_for(device.platform),
          jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
      jax.jit(function).lower(*args).compile()
  except (jax.errors.JaxRuntimeError, NotImplementedError) as e:
    return str(e).strip().splitlines()[0]
  return None


def attention_that_compiles(request: Request, device: Any, implementation: str = "auto"
                            ) -> Lowered:
  """The attention kernel `AttentionPlan((implementation,))` selects for `request` on
  `device`'s chip, compiled forward and backward at one row of it (what a compiler
  refuses, a block size, is per row), else the next eligible one of the order.

  Raises:
    NoImplementationError: no kernel fits or compiles; names each reason.
  """
  backend, refused, order = backend_of(device), [], (implementation,)
  while True:
    with implementations.compiling_for(backend.platform):
      choice = AttentionPlan(order, "the compile check", backend=backend).select(request)
    reason = attention_compile_error(choice, device)
    if reason is None:
      why = "; ".join(v.reason for v in choice.verdicts if v.name in choice.order and
                      v.status == "rejected") or f"first of {', '.join(choice.order)}"
      return Lowered(choice.name, why, tuple(refused))
    refused.append(f"{choice.name}: {reason}")
    rest = choice.order[choice.order.index(choice.name) + 1:]
    if not rest:
      raise NoImplementationError(f"no attention kernel compiles for {device.device_kind}: "
                                  + "; ".join(refused))
    order = rest


def attention_compile_error(choice, device: Any) -> str | None:
  """Why `device`'s compiler refuses `choice`'s kernel (a `kernels.Choice`), forward and
  backward at one row of its request, or None."""
  return compile_error(_attention_loss(choice), _attention_args(choice.request), device)


def _attention_args(request: Request) -> tuple[jax.ShapeDtypeStruct, ...]:
  q = jax.ShapeDtypeStruct((1, *request.q_shape[1:]), request.dtype)
  k = jax.ShapeDtypeStruct((1, *request.k_shape[1:]), request.dtype)
  ids = (jax.ShapeDtypeStruct((1, request.q_len), jnp.int32),) if request.segment_ids else ()
  return q, k, k, *ids


def _attention_loss(choice) -> Callable[..., Any]:
  request = choice.request
  plan = AttentionPlan((choice.name,), "the compile check", backend=choice.backend)

  def loss(q, k, v, ids=None):
    out = attention(q, k, v, causal=request.causal, segment_ids=ids, scale=request.scale,
                    local_window=request.local_window, logits_soft_cap=request.logits_soft_cap,
                    plan=plan)
    return out.astype(jnp.float32).sum()

  return jax.grad(loss, argnums=(0, 1, 2))


def grouped_matmul_that_compiles(requested: str, device: Any, lhs_shape: tuple[int, int],
                                 rhs_shape: tuple[int, int, int], dtype: Any = jnp.bfloat16
                                 ) -> Lowered:
  """The MoE grouped matmul `choose_grouped_matmul` picks on `device`'s chip for lhs
  [M, K] and rhs [G, K, N], compiled with its gradient; xla where the compiler refuses."""
  name, why = experts.choose_grouped_matmul(requested, device.platform, device.device_kind,
                                            shapes=(lhs_shape, rhs_shape))

  def loss(lhs, rhs, sizes, name):
    out = experts.grouped_matmul(lhs, rhs, sizes, implementation=name)
    return out.astype(jnp.float32).sum()

  args = (jax.ShapeDtypeStruct(lhs_shape, dtype), jax.ShapeDtypeStruct(rhs_shape, dtype),
          jax.ShapeDtypeStruct(rhs_shape[:1], jnp.int32))
  step = lambda name: jax.grad(lambda *a: loss(*a, name), argnums=(0, 1))
  return _or_xla(name, why, step, args, device)


def paged_attention_that_compiles(requested: str, device: Any, q_shape: tuple[int, ...],
                                  pool_shape: tuple[int, ...], width: int,
                                  dtype: Any = jnp.bfloat16, **options: Any) -> Lowered:
  """The paged attention `choose_paged_attention` picks on `device`'s chip for q
  [B, T, N, H] over pools [K, pages, page_size, H] and block tables [B, width] (`options`:
  `scale`, `logits_soft_cap`, `local_window`), compiled; xla where the kernel does not take
  the shapes or the compiler refuses it."""
  name, why = paged.choose_paged_attention(requested, device.platform, device.device_kind)
  q, pool = jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(pool_shape, dtype)
  if name == "pallas_tpu" and not paged_tpu.tpu_kernel_fits(q, pool):
    name, why = "xla", (f"{why}; it does not take head_dim {q_shape[-1]} and {pool_shape[0]} "
                        f"key/value heads of {jnp.dtype(dtype).name}: the xla loop")
  if name == "pallas_gpu" and (q_shape[1] != 1 or options.get("local_window") is not None):
    name, why = "xla", f"{why}; a chunk of queries or a sliding window: the xla loop"
  options.setdefault("scale", q_shape[-1] ** -0.5)
  args = (q, pool, pool, jax.ShapeDtypeStruct((q_shape[0], width), jnp.int32),
          jax.ShapeDtypeStruct(q_shape[:2], jnp.int32))
  step = lambda name: lambda *a: paged.paged_attention(*a, implementation=name, **options)
  return _or_xla(name, why, step, args, device)


def _or_xla(name: str, why: str, step: Callable[[str], Callable[..., Any]],
            args: tuple[Any, ...], device: Any) -> Lowered:
  """`name` if `step(name)` compiles on `device`, else xla with the refusal (xla itself,
  refused, raises: nothing is left to fall back to)."""
  reason = compile_error(step(name), args, device)
  if reason is None:
    return Lowered(name, why)
  if name == "xla":
    raise RuntimeError(f"xla refused on {device.device_kind}: {reason}")
  refused = f"{name}: {reason}"
  if (again := compile_error(step("xla"), args, device)) is not None:
    raise RuntimeError(f"{refused}; xla: {again}")
  return Lowered("xla", f"{name} refused by the compiler: falls back to xla", (refused,))


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
  """The persistent compilation cache off: it would keep programs for compile-only devices
  that no client can load back."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
