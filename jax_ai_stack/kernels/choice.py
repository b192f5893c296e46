"""The outcome of kernel selection: a `Choice`, its verdicts, their report and JSON.

A `Choice` keeps one `Verdict` per registered implementation, so that the
chosen kernel, the fallbacks and every rejection with its reason can be shown
as a table (`report`) or stored as JSON (`to_dict`, e.g. in checkpoint
metadata).

Example:
  >>> from jax_ai_stack.kernels.plan import AttentionPlan
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((1, 16, 2, 8), (1, 16, 2, 8), "float32")
  >>> choice = AttentionPlan(("cudnn", "xla"), "example").select(request, backend=Backend("cpu"))
  >>> choice.name, choice.fallbacks, choice.deterministic
  ('xla', (('xla', False),), True)
  >>> choice.reasons[:2]
  ('cudnn: rejected (runs on gpu, not cpu)', 'xla: chosen')
  >>> choice.to_dict()["verdicts"][0]["status"]
  'rejected'
  >>> print(choice.report())  # doctest: +ELLIPSIS
  Attention on cpu: q [1,16,2,8] k/v [1,16,2,8] float32, causal
  Order tried (example): cudnn, xla
  (capability checks only: candidates were not traced)
  <BLANKLINE>
    implementation       eligible  why not / notes
    cudnn                no        runs on gpu, not cpu
  * xla                  yes
  ...
  Chosen: xla (deterministic)
"""

from __future__ import annotations

import dataclasses

from jax_ai_stack import determinism
from jax_ai_stack.kernels import table
from jax_ai_stack.kernels.request import Backend, Request


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What selection concluded about one implementation."""

  name: str
  status: str
  """"chosen", "eligible" (would be a fallback), "rejected" or "not in order"."""
  reason: str = ""
  interpret: bool = False


def nondeterminism(name: str) -> str | None:
  """Why `name`'s gradients are not bitwise reproducible here, or None."""
  # XLA makes cuDNN use its deterministic backward under this flag.
  if name == "cudnn" and determinism.gpu_flag_set():
    return None
  return table.IMPLEMENTATIONS[name].nondeterministic


def _traits(name: str) -> str:
  impl = table.IMPLEMENTATIONS[name]
  notes = ["GQA by repeating K/V heads"] if impl.gqa == "repeat" else []
  if why := nondeterminism(name):
    notes.append(f"nondeterministic: {why}")
  return "; ".join(notes)


def _row(verdict: Verdict, width: int) -> str:
  """One line of the report's table: mark, name, eligible, notes."""
  eligible = "yes" if verdict.status in ("chosen", "eligible") else "no"
  notes = [verdict.reason] if verdict.reason else []
  if eligible == "yes":
    if verdict.interpret:
      notes.append("Pallas interpret mode (slow)")
    if traits := _traits(verdict.name):
      notes.append(traits)
  mark = "*" if verdict.status == "chosen" else " "
  return f"{mark} {verdict.name:<{width}}  {eligible:<8}  {'; '.join(notes)}".rstrip()


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation selected for a request on a backend, and why."""

  name: str | None
  """The implementation that runs; None only from `report` when none fits."""
  request: Request
  backend: Backend
  source: str
  """Where the order came from: argument, environment, autotune file, pin, auto."""
  order: tuple[str, ...]
  """The order tried."""
  verdicts: tuple[Verdict, ...]
  """One per registered implementation: tried ones in order, then the rest."""
  probed: bool
  """Whether candidates were traced (abstractly) to catch NotImplementedError."""

  @property
  def interpret(self) -> bool:
    return any(v.interpret for v in self.verdicts if v.name == self.name)

  @property
  def fallbacks(self) -> tuple[tuple[str, bool], ...]:
    """(name, interpret) of the chosen implementation, then other eligible ones."""
    return tuple((v.name, v.interpret) for v in self.verdicts if v.status in ("chosen", "eligible"))

  @property
  def deterministic(self) -> bool:
    """Whether a train step running this kernel is bitwise reproducible: the kernel
    and XLA's own ops on this backend (`determinism.step_nondeterminism`)."""
    return self.nondeterminism() is None

  def nondeterminism(self) -> str | None:
    """Why a train step with this kernel is not bitwise reproducible, or None."""
    if self.name is None:
      return "no implementation chosen"
    return nondeterminism(self.name) or determinism.step_nondeterminism(self.backend.platform)

  @property
  def reasons(self) -> tuple[str, ...]:
    """One line per implementation: "name: status (reason)"."""
    return tuple(
        f"{v.name}: {v.status}" + (f" ({v.reason})" if v.reason else "") for v in self.verdicts
    )

  def to_dict(self) -> dict:
    """JSON-ready summary, e.g. for checkpoint metadata."""
    return {
        "implementation": self.name,
        "interpret": self.interpret,
        "deterministic": self.deterministic,
        "source": self.source,
        "platform": self.backend.platform,
        "device_kind": self.backend.device_kind,
        "request": self.request.to_dict(),
        "verdicts": [
            {**dataclasses.asdict(v), "calls": table.IMPLEMENTATIONS[v.name].summary}
            for v in self.verdicts
        ],
    }

  def report(self) -> str:
    """A table of every implementation: eligible or not, why, and the choice."""
    lines = [
        f"Attention on {self.backend.describe()}: {self.request.describe()}",
        f"Order tried ({self.source}): {', '.join(self.order)}",
    ]
    if not self.probed:
      lines.append("(capability checks only: candidates were not traced)")
    width = max(len(n) for n in table.IMPLEMENTATIONS)
    lines += ["", f"  {'implementation':<{width}}  {'eligible':<8}  why not / notes"]
    lines += [_row(v, width) for v in self.verdicts]
    lines.append("")
    if self.name is None:
      lines.append("Chosen: none fits")
    else:
      why = self.nondeterminism()
      verdict = "deterministic" if why is None else f"NONDETERMINISTIC: {why}"
      how = " in Pallas interpret mode" if self.interpret else ""
      lines.append(f"Chosen: {self.name}{how} ({verdict})")
    return "\n".join(lines)
