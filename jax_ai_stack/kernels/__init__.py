"""Attention kernels chosen per backend. `attention` is the one entry point.

Which kernels may run is an explicit, immutable `AttentionPlan`, which
`resolve_plan` builds once from the settings (an implementation name, the
`JAX_AI_STACK_ATTENTION` variable, an autotune file). `plan.select(request)`
says which implementation runs for a `Request` and why; `autotune` measures
the choice and writes it to a file that later runs read into their plan.

Modules, one job each:
  request          `Request` (shapes, dtype, masks) and `Backend`
  table            `IMPLEMENTATIONS` (what each kernel accepts), `PREFERENCE`
  rules            hardware and library-version rules of the table
  implementations  adapters for jax.nn and tokamax, and `call`, which runs one
  pallas           adapters for JAX's Pallas kernels
  selection        parsing names, probing, deciding
  choice           `Choice` (and `Verdict`): the outcome, its report and JSON
  plan             `AttentionPlan`
  resolve          `resolve_plan`, and `select` / `report` shortcuts
  attention        `attention`
  autotune_file    the autotune file, read into a plan
  autotuning       `autotune`: measuring the choice
  cli              `jax-ai-stack kernels`
"""

from jax_ai_stack.kernels.attention import attention
from jax_ai_stack.kernels.autotune_file import AUTOTUNE_FILENAME, AutotuneError, load_plan
from jax_ai_stack.kernels.autotuning import autotune, autotune_unsupported_reason
from jax_ai_stack.kernels.choice import Choice, Verdict
from jax_ai_stack.kernels.plan import AttentionPlan, clear_cache
from jax_ai_stack.kernels.request import Backend, Request
from jax_ai_stack.kernels.resolve import ENV_VAR, report, resolve_plan, select
from jax_ai_stack.kernels.selection import (
    NoImplementationError,
    UnknownImplementationError,
    parse_implementation,
)
from jax_ai_stack.kernels.table import (
    AUTO,
    IMPLEMENTATIONS,
    PREFERENCE,
    Implementation,
    ImplementationName,
)

__all__ = [
    "AUTO",
    "AUTOTUNE_FILENAME",
    "AttentionPlan",
    "AutotuneError",
    "Backend",
    "Choice",
    "ENV_VAR",
    "IMPLEMENTATIONS",
    "Implementation",
    "ImplementationName",
    "NoImplementationError",
    "PREFERENCE",
    "Request",
    "UnknownImplementationError",
    "Verdict",
    "attention",
    "autotune",
    "autotune_unsupported_reason",
    "clear_cache",
    "load_plan",
    "parse_implementation",
    "report",
    "resolve_plan",
    "select",
]
