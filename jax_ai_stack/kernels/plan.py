"""`AttentionPlan`: which attention kernels may run, as one explicit value.

A plan is an order of implementation names ("auto" = the platform's
preference), where it came from, requests pinned to one implementation,
tokamax kernel configs from an autotune file, and the paged attention of the
generation engine (`paged_attention`: chosen for the plan's backend, as the
rest, never for the host that traces). It is immutable and hashable, so
a model can hold it as static structure, `jit` can key on it, and selection is
cached per (plan, request, backend, probe mode): calling `attention` inside
`jit`, `grad` or `remat` costs one lookup per trace. Nothing else (no
environment variable, no context) changes what a plan selects; `resolve_plan`
builds one from the settings once.

Example:
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((2, 16, 4, 8), (2, 16, 2, 8), "float32")
  >>> plan = AttentionPlan(("auto",), source="example")
  >>> plan.select(request, backend=Backend("cpu")).name
  'tokamax_xla'
  >>> pinned = plan.pin(plan.select(request, backend=Backend("cpu"), probe=False))
  >>> AttentionPlan.from_dict(pinned.to_dict()) == pinned
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from jax_ai_stack.kernels import implementations, paged, selection, table
from jax_ai_stack.kernels import request as request_lib
from jax_ai_stack.kernels.choice import Choice
from jax_ai_stack.kernels.request import Backend, Request


def _check_pins(pins: Any, origin: str) -> tuple[tuple[Request, str], ...]:
  """Pins as a tuple of (Request, known name); ValueError naming `origin` otherwise."""
  checked = []
  for pin in pins:
    if not (isinstance(pin, (tuple, list)) and len(pin) == 2 and isinstance(pin[0], Request)):
      raise ValueError(f"{origin}: a pin must be (Request, implementation name), got {pin!r}")
    request, name = pin
    if not isinstance(name, str) or name not in table.IMPLEMENTATIONS:
      raise ValueError(
          f"{origin}: a pin names one implementation, not {name!r}; known: "
          + ", ".join(table.IMPLEMENTATIONS)
      )
    checked.append((request, name))
  return tuple(checked)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """The attention kernels a model may run: an order, pins, tuned configs."""

  order: tuple[str, ...]
  """Names tried in order; may contain "auto" (the platform's `PREFERENCE`)."""
  source: str
  """Where the order came from, for reports, e.g. "environment JAX_AI_STACK_ATTENTION"."""
  pins: tuple[tuple[Request, str], ...] = ()
  """Exact requests -> implementation (from an autotune file, or pinned by the trainer)."""
  tokamax_configs: str | None = None
  """A tokamax `AutotuningResult` as JSON (tuned block sizes), or None."""
  backend: Backend | None = None
  """The backend the plan selects for when a call names none: the devices a run is
  compiled for (a TPU slice's compile-only devices, say); None: the current backend.
  Not saved with the plan: a run reopened elsewhere selects for where it is."""
  paged: str = "auto"
  """The generation engine's paged attention: "auto" or one of `paged.PAGED_ATTENTIONS`,
  chosen by `paged_attention` for the plan's backend."""

  def __post_init__(self):
    # Normalised here so that equal plans hash equal however they were written.
    order = selection.parse_implementation(self.order, origin=self.source)
    object.__setattr__(self, "order", order)
    object.__setattr__(self, "pins", _check_pins(self.pins, self.source))
    paged.choose_paged_attention(self.paged, "cpu")  # A ValueError naming the choices.

  def select(self, request: Request, *, backend: Backend | None = None,
             probe: bool | None = None) -> Choice:
    """The implementation `attention` runs for `request`, and why.

    A pinned request gets exactly its pinned implementation; others the first
    of `order` that fits.

    Args:
      request: shapes, dtype and masks of the call.
      backend: the backend to select for; default: the plan's, else the current one.
      probe: trace candidates abstractly (`jax.eval_shape` of forward and
        backward) to skip those raising NotImplementedError. Default: only when
        selecting for the real backend.

    Raises:
      NoImplementationError: none fits; the message lists every rejection.
    """
    choice = _choose(self, request, *self._backend_and_mode(backend, probe, every=False))
    if choice.name is None:
      raise selection.no_fit_error(choice)
    return choice

  def report(self, request: Request, *, backend: Backend | None = None,
             probe: bool | None = None) -> Choice:
    """Like `select`, but probes every candidate and never raises for no fit."""
    return _choose(self, request, *self._backend_and_mode(backend, probe, every=True))

  def pin(self, choice: Choice) -> AttentionPlan:
    """A copy in which `choice.request` always selects `choice.name`.

    What the trainer does once per run, so that evaluation and resume run the
    very kernel the training run logged, whatever the probes say later.
    """
    if choice.name is None:
      raise ValueError(
          f"cannot pin a choice that names no implementation: {choice.request.describe()}"
      )
    pins = tuple((r, n) for r, n in self.pins if r != choice.request)
    return dataclasses.replace(self, pins=pins + ((choice.request, choice.name),))

  def paged_attention(self, *, sinks: bool = False, chunked: bool = False) -> tuple[str, str]:
    """(implementation, why) of the engine's paged attention on the plan's backend (else
    the current one): what a model built with this plan decodes with (`sinks`, `chunked`: a
    model with attention sinks or chunked attention, which only the paged xla loop takes)."""
    backend = self.backend or request_lib.current_backend()
    return paged.choose_paged_attention(self.paged, backend.platform, backend.device_kind,
                                        sinks=sinks, chunked=chunked)

  def to_dict(self) -> dict:
    """JSON-ready (e.g. for checkpoint metadata); `from_dict` reads it back."""
    return {
        "order": list(self.order),
        "source": self.source,
        "pins": [{"request": r.to_dict(), "implementation": n} for r, n in self.pins],
        "tokamax_configs": self.tokamax_configs,
        "paged": self.paged,
    }

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> AttentionPlan:
    """The inverse of `to_dict`; ValueError names what is malformed."""
    if not isinstance(data, Mapping) or "order" not in data or "source" not in data:
      raise ValueError(f"an attention plan needs 'order' and 'source', got {data!r:.200}")
    pins = []
    for i, pin in enumerate(data.get("pins") or ()):
      try:
        pins.append((Request.from_dict(pin["request"]), pin["implementation"]))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"attention plan pins[{i}] is malformed ({e})") from None
    configs = data.get("tokamax_configs")
    if configs is not None and not isinstance(configs, str):
      raise ValueError(
          f"attention plan tokamax_configs must be JSON text, got {type(configs).__name__}"
      )
    return cls(tuple(data["order"]), str(data["source"]), tuple(pins), configs,
               paged=str(data.get("paged", "auto")))  # Plans saved before it: auto.

  def kernel_configs(self) -> contextlib.AbstractContextManager:
    """A context in which tokamax uses this plan's tuned configs (else a no-op).

    Enter it around tracing: tokamax reads its configs when a kernel is traced.
    Each call returns a fresh context (tokamax's cannot be entered twice).
    """
    if self.tokamax_configs is None:
      return contextlib.nullcontext()
    return implementations.import_tokamax().AutotuningResult.loads(self.tokamax_configs)

  def _backend_and_mode(self, backend: Backend | None, probe: bool | None, *, every: bool):
    """The backend to select for and how to probe: a call's own backend, else the plan's
    (probed as the kernels trace for its devices: `selection.probe`), else the current one."""
    if backend is None and self.backend is not None:
      backend, probe = self.backend, True if probe is None else probe
    mode = selection.probe_mode(backend, probe, every=every)
    return backend or request_lib.current_backend(), mode

  def _names_for(self, request: Request) -> tuple[tuple[str, ...], str]:
    """(names to try, where they came from) for one request: its pin, or the order."""
    for pinned, name in self.pins:
      if pinned == request:
        return (name,), f"pinned by {self.source}"
    return self.order, self.source




@functools.lru_cache(maxsize=512)
def _choose(plan: AttentionPlan, request: Request, backend: Backend, mode: str) -> Choice:
  names, source = plan._names_for(request)  # pylint: disable=protected-access
  return selection.decide(request, backend, names, source=source, mode=mode)


def clear_cache() -> None:
  """Forgets cached choices (after registering stand-in implementations in tests)."""
  _choose.cache_clear()
