"""Choosing a kernel: parse an order, check and probe each candidate, decide.

`decide` turns a request, a backend and an order of names into a `Choice`: the
first implementation whose capability checks pass and whose abstract trace
(forward and backward) does not raise `NotImplementedError` (the convention
tokamax and JAX use for "not this input"), with the reason each other one was
passed over. It reads no environment and no global setting: where the order
comes from is `AttentionPlan`'s job (`plan`), which also caches the result.

Example:
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((2, 16, 4, 8), (2, 16, 2, 8), "float32")
  >>> decide(request, Backend("cpu"), ("auto",), source="example", mode="none").name
  'tokamax_xla'
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ai_stack.errors import UsageError
from jax_ai_stack.kernels import implementations, table
from jax_ai_stack.kernels import names as names_lib
from jax_ai_stack.kernels import request as request_lib
from jax_ai_stack.kernels.choice import Choice, Verdict
from jax_ai_stack.kernels.names import UnknownImplementationError
from jax_ai_stack.kernels.request import Backend, Request
from jax_ai_stack.kernels.table import AUTO


class NoImplementationError(NotImplementedError, UsageError):
  """No attention implementation fits; the message names every rejection.

  A `UsageError`: it means the kernels asked for cannot run here (e.g.
  `model.attention_impl=cudnn` on CPU), which the user fixes, so the command
  line prints it as one line.
  """


def parse_implementation(
    spec: str | Sequence[str], *, origin: str = "implementation"
) -> tuple[str, ...]:
  """"auto" / "a,b" / ["a", "b"] -> names; the error names `origin` and the bad name.

  As `names.parse`, against `table.IMPLEMENTATIONS` as it is at call time (tests
  register stand-ins there).

  Raises:
    UnknownImplementationError (a ValueError): no names, or an unknown one.
  """
  return names_lib.parse(spec, origin=origin, known=table.IMPLEMENTATIONS)


def expand_order(names: Sequence[str], platform: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(order with "auto" replaced by `platform`'s preference, names given explicitly)."""
  order: list[str] = []
  for name in names:
    for expanded in (table.PREFERENCE.get(platform, ("xla",)) if name == AUTO else (name,)):
      if expanded not in order:
        order.append(expanded)
  return tuple(order), tuple(n for n in names if n != AUTO)


def probe_mode(backend: Backend | None, probe: bool | None, *, every: bool) -> str:
  """"none", "first" (until one passes) or "all" (for reports).

  By default only the real backend is probed: tracing needs the real
  platform, and a simulated one (a `Backend` given, or a patched
  `current_backend`) cannot be traced on.
  """
  if probe is None:
    probe = backend is None and request_lib.current_backend().platform == jax.default_backend()
  return ("all" if every else "first") if probe else "none"


def probe(impl: table.Implementation, request: Request, interpret: bool,
          platform: str | None = None) -> str | None:
  """Traces forward+backward abstractly, for `platform` (None: this host's backend); the
  reason if the kernel refuses."""
  dtype = jnp.dtype(request.dtype)
  q = jax.ShapeDtypeStruct(request.q_shape, dtype)
  k = jax.ShapeDtypeStruct(request.k_shape, dtype)
  ids = None
  if request.segment_ids:
    ids = jax.ShapeDtypeStruct((request.batch, request.q_len), jnp.int32)
  lengths = jax.ShapeDtypeStruct((request.batch,), jnp.int32) if request.kv_seq_lengths else None

  def loss(q, k, v, ids, lengths):
    out = implementations.call(impl.run, request, q, k, v, ids, lengths, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32))

  try:
    with implementations.compiling_for(platform or jax.default_backend()):
      jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, ids, lengths)
  # How kernels refuse inputs; and a library a kernel needs that is missing here (jax's
  # cudnn attention compiled for a GPU from a host without the cuDNN wheels: "cuDNN not found").
  except (NotImplementedError, ValueError, RuntimeError) as e:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__} when traced: {first_line[:200]}"
  return None


def decide(
    request: Request,
    backend: Backend,
    names: Sequence[str],
    *,
    source: str,
    mode: str,
) -> Choice:
  """Checks (and per `mode`, probes) `names` in order; never raises for no fit.

  Args:
    names: implementation names, "auto" standing for the platform's preference.
    source: where the names came from, for the report.
    mode: "none", "first" or "all", as `probe_mode` returns.
  """
  order, explicit = expand_order(names, backend.platform)
  verdicts: list[Verdict] = []
  chosen = None
  for name in order:
    impl = table.IMPLEMENTATIONS[name]
    reason, interpret = impl.check(request, backend, named=name in explicit)
    if reason is None and mode != "none" and (chosen is None or mode == "all"):
      reason = probe(impl, request, interpret, backend.platform)
    if reason is not None:
      verdicts.append(Verdict(name, "rejected", reason, interpret))
    elif chosen is None:
      chosen = name
      verdicts.append(Verdict(name, "chosen", "", interpret))
    else:
      verdicts.append(Verdict(name, "eligible", "", interpret))
  for name, impl in table.IMPLEMENTATIONS.items():
    if name not in order:
      reason, _ = impl.check(request, backend, named=False)
      verdicts.append(Verdict(name, "not in order", reason or f"not in the order ({source})"))
  return Choice(chosen, request, backend, source, order, tuple(verdicts), mode != "none")


def no_fit_error(choice: Choice) -> NoImplementationError:
  """The error for a choice that names nothing: every rejection, in order."""
  rejections = "; ".join(f"{v.name}: {v.reason}" for v in choice.verdicts if v.name in choice.order)
  return NoImplementationError(
      f"no attention implementation fits {choice.request.describe()} on"
      f" {choice.backend.describe()} (order from {choice.source}): {rejections}"
  )
