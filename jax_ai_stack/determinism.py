"""Determinism as a setting: what XLA needs, on each backend, for bitwise-equal runs.

XLA's CPU and TPU programs give the same bits every run. On a GPU they do not
by default: scatter-adds (the embedding's gradient) and some reductions use
atomics, whose order varies, so two identical runs drift apart within a few
steps and a resumed run is not the run that never stopped. XLA's flag
`--xla_gpu_deterministic_ops=true` makes every op deterministic (cuDNN's
attention backward included) at a cost in throughput: 0.82x on an H100 for
the 0.76B step (`benchmarks/accelerator.py` measures it). XLA reads its flags
once, when the backend starts, so `configure` must run before the first JAX
computation; the command line calls it once, from `train.deterministic`.

Example:
  >>> environ = {}
  >>> configure(True, environ=environ, started=False)
  >>> environ["XLA_FLAGS"]
  '--xla_gpu_deterministic_ops=true'
  >>> step_nondeterminism("gpu", environ) is None
  True
  >>> step_nondeterminism("gpu", {}) is not None
  True
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from jax_ai_stack.errors import ConfigError

GPU_FLAG = "--xla_gpu_deterministic_ops=true"
"""Deterministic scatters, reductions and cuDNN backward passes in XLA's GPU programs."""

MEASURED_COST = "0.82x throughput on an H100 at 0.76B (benchmarks/README.md)"
"""The cost of `GPU_FLAG` last measured; `benchmarks/accelerator.py` measures it again."""


def _flags(environ) -> list[str]:
  return environ.get("XLA_FLAGS", "").split()


def gpu_flag_set(environ=os.environ) -> bool:
  """Whether `XLA_FLAGS` asks for deterministic GPU ops (the last mention wins, as in XLA)."""
  mentions = [f for f in _flags(environ) if f.startswith("--xla_gpu_deterministic_ops")]
  return bool(mentions) and mentions[-1] in (GPU_FLAG, "--xla_gpu_deterministic_ops")


def backend_started() -> bool:
  """Whether JAX has started its backends (after which XLA_FLAGS is read no more)."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  return xla_bridge.backends_are_initialized()


def configure(deterministic: bool, *, environ: MutableMapping[str, str] = os.environ,
              started: bool | None = None) -> None:
  """Sets what XLA needs for `deterministic` before the backend starts.

  `deterministic=False` leaves XLA_FLAGS as the user set it. Once the backend
  has started (a notebook that already ran JAX), flags can no longer change:
  on a GPU without the flag that is a ConfigError naming both ways out, on
  other backends nothing is needed.

  Args:
    deterministic: `train.deterministic`.
    environ: the environment XLA reads (the process's).
    started: whether the backend is up; default: ask JAX.
  """
  if not deterministic or gpu_flag_set(environ):
    return
  if started if started is not None else backend_started():
    import jax  # pylint: disable=g-import-not-at-top

    if jax.default_backend() == "gpu":
      raise ConfigError(
          "train.deterministic=true needs XLA_FLAGS=" + GPU_FLAG + " before JAX starts its "
          "GPU backend: set it in the environment (or call jax_ai_stack.determinism."
          "configure(True) before the first JAX computation), or set train.deterministic=false")
    return
  environ["XLA_FLAGS"] = " ".join([*_flags(environ), GPU_FLAG])


def step_nondeterminism(platform: str, environ=os.environ) -> str | None:
  """Why a train step's XLA ops are not bitwise reproducible on `platform`, or None."""
  if platform == "gpu" and not gpu_flag_set(environ):
    return ("XLA's GPU scatters and reductions use atomics unless XLA_FLAGS has "
            f"{GPU_FLAG} (train.deterministic=true sets it)")
  return None


def describe(deterministic: bool, platform: str, environ=os.environ) -> str:
  """The start-up line's word on determinism: on or off, how, and what it costs."""
  if platform == "gpu":
    if gpu_flag_set(environ):
      state = "on" if deterministic else "on (XLA_FLAGS asks for it)"
      return f"determinism: {state}: XLA deterministic GPU ops; costs {MEASURED_COST}"
    return ("determinism: off (train.deterministic=false): two identical runs differ after a "
            "few steps and a resume is not bitwise")
  how = "XLA's CPU ops are deterministic" if platform == "cpu" else (
      f"XLA's {platform.upper()} ops are deterministic")
  state = "on" if deterministic else "on anyway (train.deterministic=false changes nothing here)"
  return f"determinism: {state}: {how}, no cost"
