"""Autotune attention once and write the measured choices to an autotune file.

`autotune` runs `tokamax.autotune` (block sizes and other kernel configs) for
each eligible tokamax kernel at the model's requests, then times every
eligible implementation forward+backward and keeps the fastest. Timings are
noisy, so a rerun could pick differently; that is why the result is a file
(`autotune_file`): training and resume read the same file into their
`AttentionPlan` and therefore run the same kernels with the same configs.

Typical use (the trainer):
  path = pathlib.Path(workdir) / AUTOTUNE_FILENAME
  if not path.exists() and config.autotune_attention:
    autotune([request], path)
  plan = resolve_plan(config.attention_impl, autotune_file=path)
  with plan.kernel_configs():
    ...  # trace and run the train step with `plan`

Example: the inputs every candidate is timed on, and one candidate's forward.
  >>> request = Request.from_shapes((1, 16, 4, 8), (1, 16, 2, 8), "float32", segment_ids=True)
  >>> q, k, v, ids, lengths = inputs(request)
  >>> q.shape, k.shape, lengths
  ((1, 16, 4, 8), (1, 16, 2, 8), None)
  >>> ids.tolist()
  [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]]
  >>> forward_fn("xla", request)(q, k, v, ids, lengths).shape
  (1, 16, 4, 8)
  >>> reason = autotune_unsupported_reason()  # None where `autotune` can run.
  >>> reason is None or "tokamax" in reason
  True
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import autotune_file, implementations, rules, selection, table
from jax_ai_stack.kernels import request as request_lib
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.request import Request

AUTOTUNE_FILENAME = autotune_file.AUTOTUNE_FILENAME
AutotuneError = autotune_file.AutotuneError
FORMAT = autotune_file.FORMAT

# tokamax versions whose `tokamax.autotune` is known not to work with their
# row's JAX: 0.0.12 fails in hlo_utils with
# "AttributeError: 'NameLoc' object has no attribute 'is_a_name'".
_BROKEN_TOKAMAX_AUTOTUNE = {(0, 0, 12): "'NameLoc' object has no attribute 'is_a_name'"}

_CANDIDATES = AttentionPlan((table.AUTO,), "auto: the candidates autotune times")


def autotune_unsupported_reason() -> str | None:
  """Why `autotune` cannot run with the installed tokamax, or None."""
  version = rules.tokamax_version()
  if not version:
    return "tokamax is not installed"
  if version in _BROKEN_TOKAMAX_AUTOTUNE:
    return (
        f"tokamax {'.'.join(map(str, version))} crashes in tokamax.autotune"
        f" ({_BROKEN_TOKAMAX_AUTOTUNE[version]}); autotuning needs the tokamax of"
        " another matrix row (0.0.17 works). Attention still runs, untuned."
    )
  return None


def forward_fn(name: str, request: Request):
  """One implementation's forward, as a function of (q, k, v, ids, lengths)."""
  run = table.IMPLEMENTATIONS[name].run
  return lambda q, k, v, ids, lengths: implementations.call(run, request, q, k, v, ids, lengths)


def _forward_backward(forward):
  """A jitted function whose trace holds both the forward and the VJP kernels."""

  def grads(q, k, v, ids, lengths):
    loss = lambda q, k, v: jnp.sum(jnp.square(forward(q, k, v, ids, lengths).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return jax.jit(grads)


def inputs(request: Request) -> tuple:
  """Random (q, k, v, segment_ids, kv_seq_lengths) for a request.

  Segment ids: 4 segments; lengths: 3/4 of S. The benchmark times the same.
  """
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(request.dtype)
  q = jax.random.normal(keys[0], request.q_shape, dtype)
  k = jax.random.normal(keys[1], request.k_shape, dtype)
  v = jax.random.normal(keys[2], request.k_shape, dtype)
  ids = lengths = None
  if request.segment_ids:
    ids = jnp.arange(request.q_len) * 4 // request.q_len
    ids = jnp.broadcast_to(ids, (request.batch, request.q_len))
  if request.kv_seq_lengths:
    lengths = jnp.full((request.batch,), max(1, request.kv_len * 3 // 4), jnp.int32)
  return q, k, v, ids, lengths


def time_forward_backward(
    functions: dict, args: Sequence[Any], *, iterations: int, rounds: int,
    others: Mapping[str, Callable[[int], Sequence[float]]] | None = None,
) -> dict:
  """Best forward+backward milliseconds of each of `functions`, interleaved.

  Uses tokamax's benchmarking (device timers on GPU and TPU, wall clock on
  CPU). Rounds run every function in turn, so that bursts of other work on a
  shared machine hit them alike; the fastest run is kept, because noise only
  ever adds time. `others` maps names to timers of code outside JAX (the
  benchmark's torch baseline): timer(iterations) -> milliseconds per run,
  called in the same rounds.
  """
  others = others or {}
  tokamax = implementations.import_tokamax()
  runners = {}
  for name, forward in functions.items():
    standard, arrays = tokamax.standardize_function(
        forward, *args, mode="forward_and_vjp", seed=None
    )
    runners[name] = (tokamax.benchmarking.compile_benchmark(standard, arrays), arrays)
  best = {name: float("inf") for name in [*functions, *others]}
  for _ in range(rounds):
    for name, (runner, arrays) in runners.items():
      best[name] = min(best[name], *runner(arrays, iterations=iterations).evaluation_times_ms)
    for name, timer in others.items():
      best[name] = min(best[name], *timer(iterations))
  return best


def _pick(order: Sequence[str], times_ms: dict, tolerance: float) -> str:
  """The first in preference order within `tolerance` of the fastest.

  Preferring the order among near-ties keeps reruns stable under noise.
  """
  fastest = min(times_ms.values())
  return next(n for n in order if n in times_ms and times_ms[n] <= fastest * (1 + tolerance))


@contextlib.contextmanager
def _quiet_absl():
  """Hides absl log lines below CRITICAL; failed candidate configs are expected."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def _eligible(request: Request) -> list[str]:
  """The "auto" candidates that run natively here; NoImplementationError if none."""
  choice = _CANDIDATES.report(request)
  eligible = [name for name, interpret in choice.fallbacks if not interpret]
  if not eligible:
    raise selection.NoImplementationError(
        f"nothing to autotune for {request.describe()}: " + "; ".join(choice.reasons)
    )
  return eligible


def _tune_tokamax(tokamax, names: Sequence[str], request: Request, args: tuple):
  """tokamax's tuned kernel configs (forward and VJP) of `names`' tokamax kernels, or None."""
  tuned = None
  for name in names:
    if name.startswith("tokamax_"):
      with _quiet_absl():  # tokamax logs each config it cannot compile as an ERROR.
        result = tokamax.autotune(
            _forward_backward(forward_fn(name, request)), *args,
            ignore_cache=True, progress_bar=False,
        )
      tuned = result if tuned is None else tuned | result
  return tuned


def autotune(
    requests: Iterable[Request],
    path: str | os.PathLike,
    *,
    iterations: int = 5,
    rounds: int = 2,
    tolerance: float = 0.05,
) -> pathlib.Path:
  """Tunes and times attention for `requests`; writes the choices as JSON to `path`.

  Args:
    requests: the attention calls the model makes (training, evaluation).
    path: the autotune file to write (atomically).
    iterations, rounds: timing effort per implementation.
    tolerance: prefer an earlier implementation of the preference order when
      it is within this fraction of the fastest.

  Returns:
    `path`, as a `pathlib.Path`.

  Raises:
    AutotuneError: the installed tokamax cannot autotune (see
      `autotune_unsupported_reason`).
    NoImplementationError: nothing runs natively here for a request.
  """
  if reason := autotune_unsupported_reason():
    raise AutotuneError(reason)
  tokamax = implementations.import_tokamax()
  entries, tuned = [], None
  for request in requests:
    eligible = _eligible(request)
    args = inputs(request)
    result = _tune_tokamax(tokamax, eligible, request, args)
    if result is not None:
      tuned = result if tuned is None else tuned | result
    with tuned if tuned is not None else contextlib.nullcontext():
      times = time_forward_backward(
          {name: forward_fn(name, request) for name in eligible}, args,
          iterations=iterations, rounds=rounds,
      )
    entries.append({
        "request": request.to_dict(),
        "implementation": _pick(eligible, times, tolerance),
        "times_ms": {name: round(ms, 4) for name, ms in times.items()},
    })
  backend = request_lib.current_backend()
  return autotune_file.write(path, {
      "format": FORMAT,
      "platform": backend.platform,
      "device_kind": backend.device_kind,
      "jax_version": jax.__version__,
      "tokamax_version": tokamax.__version__,
      "entries": entries,
      # Configs that failed to compile are recorded as errors; keep only results.
      "tokamax": None if tuned is None else json.loads(tuned.dumps(prune_errors=True)),
  })
