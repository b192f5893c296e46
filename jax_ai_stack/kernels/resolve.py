"""The attention plan, resolved in one place: `resolve_plan` and `plan_for_run`.

Every caller that decides which attention kernels may run (the run builder,
the memory dry run, `jax-ai-stack kernels`, a model built without a plan)
calls this module, with what it knows; nothing else reads the settings.

Precedence, first match wins:
  1. the `implementation` argument (e.g. `model.attention_impl`), unless "auto";
  2. the environment variable `JAX_AI_STACK_ATTENTION` (a name or a
     comma-separated list) in the `environ` mapping the caller passes, so a
     user can force a kernel without code changes;
  3. an autotune file (the workdir's `attention_autotune.json`): its pinned
     requests and tuned tokamax configs;
  4. the plan a checkpoint of the run saved (`saved`), so that a resumed run
     keeps the kernel it was trained with when nothing above names one (where
     "auto" now prefers another one after an upgrade, resuming on that would
     make the run differ from one that never stopped); a saved plan that
     cannot run here (another backend) yields to 5;
  5. "auto": the backend's preference order.
A finished run opened read-only (`eval`, `generate`, `quantize`, `lora merge`:
`plan_for_run(..., read_only=True)`) runs its saved plan before all of these:
exactly the kernel it trained with. "auto" inside a list stands for the
platform's preference order. Pallas kernels run on CPU in interpret mode
(slow; for verification) only when named.

The environment is read here, when the plan is made, never while tracing: a
plan keeps selecting what it selected when it was resolved. Models and the
trainer get a plan; they read no environment.

Example:
  >>> plan = resolve_plan("auto", environ={ENV_VAR: "xla"})
  >>> plan.order, plan.source
  (('xla',), 'environment JAX_AI_STACK_ATTENTION')
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from jax_ai_stack.kernels.autotune_file import AUTOTUNE_FILENAME, load_plan
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.choice import Choice
from jax_ai_stack.kernels.request import Backend, Request
from jax_ai_stack.kernels.selection import NoImplementationError, parse_implementation
from jax_ai_stack.kernels.table import AUTO

log = logging.getLogger(__name__)

ENV_VAR = "JAX_AI_STACK_ATTENTION"
AUTO_SOURCE = "auto: the backend's preference order"


def resolve_plan(
    implementation: str | Sequence[str] = AUTO,
    *,
    origin: str = "argument implementation",
    environ: Mapping[str, str] | None = None,
    autotune_file: str | os.PathLike | None = None,
    backend: Backend | None = None,
) -> AttentionPlan:
  """The plan the settings ask for (see the module docstring for precedence).

  Args:
    implementation: "auto", a name, a comma-separated list or a sequence.
    origin: what `implementation` is called in reports and errors, e.g.
      "model.attention_impl".
    environ: where to read `JAX_AI_STACK_ATTENTION`; None: `os.environ`, now.
    autotune_file: a file `autotune` wrote, or None.
    backend: the backend an autotune file must have been tuned on; default:
      the current one.

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
    return load_plan(autotune_file, backend=backend)
  return AttentionPlan((AUTO,), AUTO_SOURCE)


def workdir_autotune_file(workdir: str | os.PathLike) -> pathlib.Path | None:
  """`<workdir>/attention_autotune.json` if it exists (what `kernels --autotune` wrote)."""
  path = pathlib.Path(workdir) / AUTOTUNE_FILENAME
  return path if path.exists() else None


def plan_for_run(
    request: Request | None,
    implementation: str | Sequence[str] = AUTO,
    *,
    origin: str = "model.attention_impl",
    environ: Mapping[str, str] | None = None,
    autotune_file: str | os.PathLike | None = None,
    saved: Mapping[str, Any] | None = None,
    read_only: bool = False,
    backend: Backend | None = None,
    probe: bool | None = None,
) -> tuple[AttentionPlan | None, Choice | None]:
  """A run's plan, pinned to the kernel its `request` runs, and that choice.

  The plan the model is built with: the training request is pinned to its
  choice, so the model runs exactly the kernel logged and saved in the
  checkpoint, whatever the probes say later.

  Args:
    request: the attention call of one train step; None (a model without
      attention): (None, None).
    implementation, origin, environ, autotune_file: as `resolve_plan`.
    backend: the backend of the devices the run is compiled for (`request.backend_of` a
      device of its mesh); the plan returned selects for it from then on. None: the
      current backend, when a call selects.
    saved: a checkpoint's `attention` metadata (`Choice.to_dict()` and
      "plan": `AttentionPlan.to_dict()`), or None. A resumed run keeps it
      unless 1-3 of the precedence name a kernel (a log line says when
      "auto" would now choose another one).
    read_only: a finished run: its saved plan as is, before everything else.
    probe: trace the candidates abstractly and skip those that refuse `request`
      (`AttentionPlan.select`); default: on the current backend only. Compiling for a
      topology's devices asks for it, inside `compiling_for` their platform.

  Raises:
    NoImplementationError: no kernel of the plan fits `request` here.
    UnknownImplementationError, AutotuneError: as `resolve_plan`.
    ValueError: `read_only` and the saved plan is malformed.
  """
  if request is None:
    return None, None
  trained = None
  if saved and "plan" in saved:
    try:
      trained = AttentionPlan.from_dict(saved["plan"])
    except ValueError:
      if read_only:
        raise
  if read_only and trained is not None:
    return (dataclasses.replace(trained, backend=backend),
            trained.select(request, backend=backend, probe=probe))
  plan = resolve_plan(implementation, origin=origin, environ=environ,
                      autotune_file=autotune_file, backend=backend)
  choice = plan.select(request, backend=backend, probe=probe)
  if trained is not None and plan.source == AUTO_SOURCE:  # Nothing named: keep it if it runs.
    try:
      kept = trained.select(request, backend=backend, probe=probe)
    except (ValueError, NoImplementationError):  # Trained on another backend, say.
      kept = None
    if kept is not None and kept.name != choice.name:
      log.info("attention: keeping %s, the kernel this run was trained with (auto now prefers "
               "%s; set model.attention_impl to change it)", kept.name, choice.name)
      return dataclasses.replace(trained, backend=backend), kept
  return dataclasses.replace(plan.pin(choice), backend=backend), choice


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
