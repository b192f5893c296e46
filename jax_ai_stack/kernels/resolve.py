"""`resolve_plan`: the settings that choose attention kernels, read once, as a plan.

Precedence, first match wins:
  1. the `implementation` argument (e.g. `model.attention_impl`), unless "auto";
  2. the environment variable `JAX_AI_STACK_ATTENTION` (a name or a
     comma-separated list), so a user can force a kernel without code changes;
  3. an autotune file: its pinned requests and tuned tokamax configs;
  4. "auto": the backend's preference order.
"auto" inside a list stands for the platform's preference order. Pallas kernels
run on CPU in interpret mode (slow; for verification) only when named.

The environment is read here, when the plan is made, never while tracing: a
plan keeps selecting what it selected when it was resolved.

Example:
  >>> plan = resolve_plan("auto", environ={ENV_VAR: "xla"})
  >>> plan.order, plan.source
  (('xla',), 'environment JAX_AI_STACK_ATTENTION')
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from jax_ai_stack.kernels.autotune_file import load_plan
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.choice import Choice
from jax_ai_stack.kernels.request import Backend, Request
from jax_ai_stack.kernels.selection import parse_implementation
from jax_ai_stack.kernels.table import AUTO

ENV_VAR = "JAX_AI_STACK_ATTENTION"
AUTO_SOURCE = "auto: the backend's preference order"


def resolve_plan(
    implementation: str | Sequence[str] = AUTO,
    *,
    origin: str = "argument implementation",
    environ: Mapping[str, str] | None = None,
    autotune_file: str | os.PathLike | None = None,
) -> AttentionPlan:
  """The plan the settings ask for (see the module docstring for precedence).

  Args:
    implementation: "auto", a name, a comma-separated list or a sequence.
    origin: what `implementation` is called in reports and errors, e.g.
      "model.attention_impl".
    environ: where to read `JAX_AI_STACK_ATTENTION`; None: `os.environ`, now.
    autotune_file: a file `autotune` wrote, or None.

  Raises:
    UnknownImplementationError (a ValueError): a bad name; names its origin.
    AutotuneError: the autotune file cannot be used (says why).
  """
  names = parse_implementation(implementation, origin=origin)
  if names != (AUTO,):
    return AttentionPlan(names, origin)
  env = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
  if env:
    origin = f"environment {ENV_VAR}"
    return AttentionPlan(parse_implementation(env, origin=origin), origin)
  if autotune_file is not None:
    return load_plan(autotune_file)
  return AttentionPlan((AUTO,), AUTO_SOURCE)


def select(
    request: Request,
    implementation: str | Sequence[str] = AUTO,
    *,
    environ: Mapping[str, str] | None = None,
    backend: Backend | None = None,
    probe: bool | None = None,
) -> Choice:
  """`resolve_plan(implementation, environ=environ).select(request, ...)`.

  A shortcut for notebooks and the command line: the kernel `attention(...,
  implementation=implementation)` would run. Models get a plan instead.

  Raises:
    NoImplementationError: none fits; the message lists every rejection.
    UnknownImplementationError (a ValueError): a bad name.
  """
  plan = resolve_plan(implementation, environ=environ)
  return plan.select(request, backend=backend, probe=probe)


def report(
    request: Request,
    implementation: str | Sequence[str] = AUTO,
    *,
    environ: Mapping[str, str] | None = None,
    backend: Backend | None = None,
    probe: bool | None = None,
) -> Choice:
  """Like `select`, but probes every candidate and never raises for no fit."""
  plan = resolve_plan(implementation, environ=environ)
  return plan.report(request, backend=backend, probe=probe)
