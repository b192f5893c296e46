"""Autotune attention once, pin the result in a JSON file, reload it on resume.

`autotune` runs `tokamax.autotune` (block sizes and other kernel configs) for
each eligible tokamax kernel at the model's shapes, then times every eligible
implementation forward+backward and keeps the fastest. Timings are noisy, so a
rerun could pick differently; that is why the result is a file: training and
resume `load_autotune` the same file and therefore run the same kernels with
the same configs, and the numerics do not change between restarts.

Typical use (the trainer):
  path = pathlib.Path(workdir) / AUTOTUNE_FILENAME
  if not path.exists() and config.autotune_attention:
    autotune([(q_shape, k_shape)], path, dtype="bfloat16")
  with (load_autotune(path) if path.exists() else contextlib.nullcontext()):
    ...  # trace and run the train step

Enter `load_autotune` before the step is first traced: choices are made at
trace time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import implementations as impls
from jax_ai_stack.kernels import registry

AUTOTUNE_FILENAME = "attention_autotune.json"
FORMAT = "jax-ai-stack/attention-autotune/1"

# tokamax versions whose `tokamax.autotune` is known not to work with their
# row's JAX: 0.0.12 fails in hlo_utils with
# "AttributeError: 'NameLoc' object has no attribute 'is_a_name'".
_BROKEN_TOKAMAX_AUTOTUNE = {(0, 0, 12): "'NameLoc' object has no attribute 'is_a_name'"}


class AutotuneError(RuntimeError):
  """Autotuning is unavailable, or an autotune file cannot be used (says why)."""


def autotune_unsupported_reason() -> str | None:
  """Why `autotune` cannot run with the installed tokamax, or None."""
  version = registry._tokamax_version()  # pylint: disable=protected-access
  if not version:
    return "tokamax is not installed"
  if version in _BROKEN_TOKAMAX_AUTOTUNE:
    return (
        f"tokamax {'.'.join(map(str, version))} crashes in tokamax.autotune"
        f" ({_BROKEN_TOKAMAX_AUTOTUNE[version]}); autotuning needs the tokamax of"
        " another matrix row (0.0.17 works). Attention still runs, untuned."
    )
  return None


def _forward_fn(name: str, request: registry.Request):
  """One implementation's forward, as a function of (q, k, v, ids, lengths)."""
  impl = registry.IMPLEMENTATIONS[name]
  scale = request.head_dim ** -0.5

  def forward(q, k, v, ids, lengths):
    return impl.run(
        q, k, v, causal=request.causal, segment_ids=ids, scale=scale,
        local_window=request.local_window, kv_seq_lengths=lengths, interpret=False,
    )

  return forward


def _forward_backward(forward):
  """A jitted function whose trace holds both the forward and the VJP kernels."""

  def grads(q, k, v, ids, lengths):
    loss = lambda q, k, v: jnp.sum(jnp.square(forward(q, k, v, ids, lengths).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return jax.jit(grads)


def _inputs(request: registry.Request) -> tuple:
  """Random inputs for a request (ids: 4 segments; lengths: 3/4 of S)."""
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
    functions: dict, args: Sequence[Any], *, iterations: int, rounds: int
) -> dict:
  """Best forward+backward milliseconds of each of `functions`, interleaved.

  Uses tokamax's benchmarking (device timers on GPU and TPU, wall clock on
  CPU). Rounds run every function in turn, so that bursts of other work on a
  shared machine hit them alike; the fastest run is kept, because noise only
  ever adds time.
  """
  tokamax = impls.import_tokamax()

  runners = {}
  for name, forward in functions.items():
    standard, arrays = tokamax.standardize_function(
        forward, *args, mode="forward_and_vjp", seed=None
    )
    runners[name] = (tokamax.benchmarking.compile_benchmark(standard, arrays), arrays)
  best = {name: float("inf") for name in functions}
  for _ in range(rounds):
    for name, (runner, arrays) in runners.items():
      best[name] = min(best[name], *runner(arrays, iterations=iterations).evaluation_times_ms)
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


def autotune(
    shapes: Iterable[tuple[Sequence[int], Sequence[int]]],
    path: str | os.PathLike,
    *,
    dtype: Any = "float32",
    causal: bool = True,
    segment_ids: bool = False,
    local_window: int | None = None,
    kv_seq_lengths: bool = False,
    iterations: int = 5,
    rounds: int = 2,
    tolerance: float = 0.05,
) -> pathlib.Path:
  """Tunes and times attention at `shapes`; writes the choices as JSON to `path`.

  Args:
    shapes: (q_shape, k_shape) pairs, q [B, T, N, H] and k [B, S, K, H]: the
      shapes the model calls attention with (training, evaluation).
    path: the JSON file to write (atomically; a file already there is replaced
      only once the new one is complete).
    dtype, causal, segment_ids, local_window, kv_seq_lengths: as for `select`.
    iterations, rounds: timing effort per implementation.
    tolerance: prefer an earlier implementation of the preference order when
      it is within this fraction of the fastest.

  Returns:
    `path`, as a `pathlib.Path`.

  Raises:
    AutotuneError: the installed tokamax cannot autotune (see
      `autotune_unsupported_reason`).
  """
  if reason := autotune_unsupported_reason():
    raise AutotuneError(reason)
  tokamax = impls.import_tokamax()

  path = pathlib.Path(path)
  backend = registry.current_backend()
  entries, tuned = [], None
  for q_shape, k_shape in shapes:
    choice = registry.report(
        q_shape, k_shape, dtype, causal=causal, segment_ids=segment_ids,
        local_window=local_window, kv_seq_lengths=kv_seq_lengths, implementation=registry.AUTO,
    )
    request = choice.request
    eligible = [name for name, interpret in choice.fallbacks if not interpret]
    if not eligible:
      raise registry.NoImplementationError(
          f"nothing to autotune for {request.describe()}: " + "; ".join(choice.reasons)
      )
    args = _inputs(request)
    for name in eligible:  # Tune tokamax's kernel configs (forward and VJP) before timing.
      if name.startswith("tokamax_"):
        with _quiet_absl():  # tokamax logs each config it cannot compile as an ERROR.
          result = tokamax.autotune(
              _forward_backward(_forward_fn(name, request)), *args,
              ignore_cache=True, progress_bar=False,
          )
        tuned = result if tuned is None else tuned | result
    with tuned if tuned is not None else contextlib.nullcontext():
      times = time_forward_backward(
          {name: _forward_fn(name, request) for name in eligible}, args,
          iterations=iterations, rounds=rounds,
      )
    entries.append({
        "request": request.to_dict(),
        "implementation": _pick(eligible, times, tolerance),
        "times_ms": {name: round(ms, 4) for name, ms in times.items()},
    })
  document = {
      "format": FORMAT,
      "platform": backend.platform,
      "device_kind": backend.device_kind,
      "jax_version": jax.__version__,
      "tokamax_version": tokamax.__version__,
      "entries": entries,
      # Configs that failed to compile are recorded as errors; keep only results.
      "tokamax": None if tuned is None else json.loads(tuned.dumps(prune_errors=True)),
  }
  _write_atomically(path, json.dumps(document, indent=2) + "\n")
  return path


def _write_atomically(path: pathlib.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


@dataclasses.dataclass
class LoadedAutotune:
  """A loaded autotune file; a context manager that makes `attention` use it."""

  path: pathlib.Path
  choices: dict
  """registry.Request -> implementation name."""
  tokamax_result: Any
  """A `tokamax.AutotuningResult`, or None when no tokamax kernel was tuned."""

  def __post_init__(self):
    self._contexts = []

  def __enter__(self) -> LoadedAutotune:
    pins = registry.pinned(self.choices, f"autotune file {self.path}")
    pins.__enter__()
    self._contexts.append(pins)
    if self.tokamax_result is not None:
      # Also changes a JAX config value, so functions jitted before re-trace.
      self.tokamax_result.__enter__()
      self._contexts.append(self.tokamax_result)
    return self

  def __exit__(self, *exc) -> bool:
    while self._contexts:
      self._contexts.pop().__exit__(*exc)
    return False


def load_autotune(path: str | os.PathLike) -> LoadedAutotune:
  """Reads an autotune file; use as `with load_autotune(path): ...`.

  Raises:
    AutotuneError: the file is missing, not JSON, of another format, or was
      tuned on a different device (rerun `jax-ai-stack kernels --autotune`).
  """
  path = pathlib.Path(path)
  try:
    document = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise AutotuneError(
        f"{path}: no such autotune file; create it with `jax-ai-stack kernels --autotune`"
    ) from None
  except json.JSONDecodeError as e:
    raise AutotuneError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
  if not isinstance(document, dict) or document.get("format") != FORMAT:
    found = document.get("format") if isinstance(document, dict) else type(document).__name__
    raise AutotuneError(
        f"{path}: not an attention autotune file (format {found!r}, expected {FORMAT!r})"
    )
  backend = registry.current_backend()
  tuned_on = (document.get("platform"), document.get("device_kind"))
  if tuned_on != (backend.platform, backend.device_kind):
    raise AutotuneError(
        f"{path}: tuned on {tuned_on[0]} ({tuned_on[1]}), but this is {backend.describe()};"
        " rerun `jax-ai-stack kernels --autotune` here"
    )
  choices = {}
  for i, entry in enumerate(document.get("entries", [])):
    try:
      request = registry.Request(**entry["request"])
      name = entry["implementation"]
    except (KeyError, TypeError) as e:
      raise AutotuneError(f"{path}: entries[{i}] is malformed ({e})") from None
    if name not in registry.IMPLEMENTATIONS:
      raise AutotuneError(f"{path}: entries[{i}] names unknown implementation {name!r}")
    choices[request] = name
  tokamax_result = None
  if document.get("tokamax") and document["tokamax"].get("data"):
    tokamax = impls.import_tokamax()

    try:
      tokamax_result = tokamax.AutotuningResult.loads(json.dumps(document["tokamax"]))
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing.
      raise AutotuneError(
          f"{path}: tokamax {tokamax.__version__} cannot read the kernel configs written by"
          f" tokamax {document.get('tokamax_version')}: {type(e).__name__}: {e}"
      ) from None
  return LoadedAutotune(path, choices, tokamax_result)
