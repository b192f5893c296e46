"""Attention kernels chosen per backend. `attention` is the one entry point; the
grouped matmul of mixture-of-experts layers is `grouped_matmul`.

Which kernels may run is an explicit, immutable `AttentionPlan`, which
`resolve_plan` builds once from the settings (an implementation name, the
`JAX_AI_STACK_ATTENTION` variable, an autotune file). `plan.select(request)`
says which implementation runs for a `Request` and why; `autotune` measures
the choice and writes it to a file that later runs read into their plan.

Names load on first use (`kernels.attention` imports jax; `kernels.names`
does not), so that a recipe config can check an implementation name cheaply.

Modules, one job each:
  names            the implementation names (no jax) and `parse`
  request          `Request` (shapes, dtype, masks) and `Backend`
  table            `IMPLEMENTATIONS` (what each kernel accepts), `PREFERENCE`
  rules            hardware and library-version rules of the table
  implementations  adapters for jax.nn, tokamax and `blocked`, and `call`, which runs one
  pallas           adapters for JAX's Pallas kernels
  blocked          causal attention that skips the masked keys (`xla_blocked`, CPU)
  selection        parsing names, probing, deciding
  choice           `Choice` (and `Verdict`): the outcome, its report and JSON
  plan             `AttentionPlan`
  resolve          `resolve_plan` and `plan_for_run`: the one precedence of the settings;
                   `select` / `report` shortcuts
  sharded          `AttentionSharding`: opaque kernels per shard under a mesh
  attention        `attention`
  autotune_file    the autotune file, read into a plan
  autotuning       `autotune`: measuring the choice
  cli              `jax-ai-stack kernels`
  experts          MoE experts' grouped matmul: tokamax, XLA or the dense reference
  paged            attention over a paged KV cache (the generation engine's): XLA, or
                   JAX's Pallas kernels on GPU and TPU; a plan's `paged` chooses it
  paged_tpu        the TPU's ragged paged-attention kernel: its pool layout, block sizes
  lowering         the kernel a chip's compiler takes (compile-only devices), and the
                   fallback where it refuses one

Example:
  >>> from jax_ai_stack import kernels
  >>> request = kernels.Request.from_shapes((1, 16, 2, 8), (1, 16, 2, 8), "float32")
  >>> choice = kernels.select(request, "cudnn,xla", backend=kernels.Backend("cpu"))
  >>> choice.name, choice.reasons[0]
  ('xla', 'cudnn: rejected (runs on gpu, not cpu)')
  >>> kernels.resolve_plan("xla") == kernels.AttentionPlan(("xla",), "argument implementation")
  True
"""

from jax_ai_stack.lazy import lazy_attributes
import sys
import types

_EXPORTS = {
    "AUTO": "names",
    "AUTOTUNE_FILENAME": "autotune_file",
    "AUTO_SOURCE": "resolve",
    "AttentionPlan": "plan",
    "AttentionSharding": "sharded",
    "AttentionShardingError": "sharded",
    "AutotuneError": "autotune_file",
    "Backend": "request",
    "Choice": "choice",
    "GROUPED_MATMULS": "experts",
    "ENV_VAR": "resolve",
    "IMPLEMENTATIONS": "table",
    "Implementation": "table",
    "ImplementationName": "names",
    "NoImplementationError": "selection",
    "PREFERENCE": "table",
    "Request": "request",
    "UnknownImplementationError": "names",
    "Verdict": "choice",
    "attention": "attention",
    "autotune": "autotuning",
    "autotune_unsupported_reason": "autotuning",
    "choose_grouped_matmul": "experts",
    "choose_paged_attention": "paged",
    "backend_of": "request",
    "clear_cache": "plan",
    "compiling_for": "implementations",
    "grouped_matmul": "experts",
    "load_plan": "autotune_file",
    "paged_attention": "paged",
    "parse_implementation": "selection",
    "plan_for_run": "resolve",
    "report": "resolve",
    "resolve_plan": "resolve",
    "select": "resolve",
    "workdir_autotune_file": "resolve",
}
_SUBMODULES = (
    "autotune_file", "autotuning", "blocked", "choice", "cli", "experts",
    "implementations", "lowering", "names",
    "paged", "paged_tpu", "pallas", "plan", "request", "resolve", "rules", "selection", "sharded", "table",
)  # And `attention`, whose name the function takes.
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)


class _Package(types.ModuleType):
  """Keeps `kernels.attention` the function when its module loads.

  Importing the submodule `kernels.attention` sets the package's attribute of
  that name to the module; here the function takes that place instead, as an
  eager `from ... import attention` in this file would have done.
  """

  def __setattr__(self, name, value):
    if name == "attention" and isinstance(value, types.ModuleType):
      value = value.attention
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
