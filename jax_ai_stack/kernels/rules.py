"""Hardware and library-version rules that the common capability fields cannot say.

Each rule takes a `Request` and a `Backend` and returns why the kernel cannot
run there, or None. They are plain functions so that `table` can name them per
implementation and tests can call them directly.

Example:
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((1, 128, 2, 192), (1, 128, 2, 192), "bf16")
  >>> cudnn_check(request, Backend("gpu", "Tesla T4", "7.5"))
  'head_dim 192 > 128 (cuDNN limit on this GPU)'
"""

from __future__ import annotations

import importlib.metadata
import re

from jax_ai_stack.kernels.request import Backend, Request


def version_tuple(version: str) -> tuple[int, ...]:
  """"0.0.17.dev1" -> (0, 0, 17): the numeric release, for comparisons."""
  return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def tokamax_version() -> tuple[int, ...]:
  """The installed tokamax as (major, minor, patch); () when it is not installed."""
  try:
    return version_tuple(importlib.metadata.version("tokamax"))
  except importlib.metadata.PackageNotFoundError:
    return ()


def tokamax_window_check(request: Request, backend: Backend) -> str | None:
  del backend
  if request.local_window is not None and request.q_len != request.kv_len:
    if tokamax_version() and tokamax_version() < (0, 0, 17):
      # 0.0.12 builds the window from key positions and fails when T != S.
      return "local_window with q_len != kv_len needs tokamax >= 0.0.17"
  return None


def _compute_capability(backend: Backend) -> float | None:
  try:
    return float(backend.compute_capability) if backend.compute_capability else None
  except ValueError:
    return None


def cudnn_check(request: Request, backend: Backend) -> str | None:
  capability = _compute_capability(backend)
  if capability is None:  # Only CUDA devices report an "X.Y" compute capability.
    return (f"cuDNN needs an NVIDIA GPU reporting a CUDA compute capability "
            f"(device: {backend.device_kind or 'unknown'}, none reported)")
  max_head_dim = 256 if capability >= 9.0 else 128
  if request.head_dim > max_head_dim:
    return f"head_dim {request.head_dim} > {max_head_dim} (cuDNN limit on this GPU)"
  return None


def mosaic_gpu_check(request: Request, backend: Backend) -> str | None:
  if reason := tokamax_window_check(request, backend):
    return reason
  if (_compute_capability(backend) or 0.0) >= 8.0:
    return None
  return ("Mosaic GPU needs compute capability >= 8.0"
          f" (device reports {backend.compute_capability or 'none'})")


def tpu_generation(backend: Backend) -> int | None:
  """The TPU's version from its device kind ("TPU v5 lite": 5); None when it says none."""
  match = re.search(r"TPU\s*v?(\d+)", backend.device_kind, re.IGNORECASE)
  return int(match.group(1)) if match else None


def mosaic_tpu_check(request: Request, backend: Backend) -> str | None:
  generation = tpu_generation(backend)
  if generation is not None and generation < 5:
    return f"tokamax's Mosaic TPU kernel needs TPU v5 or newer (device: {backend.device_kind})"
  return tokamax_window_check(request, backend)


BLOCKED_MIN_Q_LEN = 256
"""Below this many queries "auto" leaves CPU attention to tokamax's XLA kernel."""


def blocked_auto_check(request: Request, backend: Backend) -> str | None:
  """Where "auto" passes over `xla_blocked`, which it prefers on CPU otherwise.

  Measured forward+backward on 2 CPU cores (benchmarks/attention.py, idle
  machine): 2.2x faster than tokamax_xla at lm-small's shape (T 256), 1.6x at
  T 512; at lm-tiny's (T 128) even, and in lm-tiny's whole train step 10%
  slower, so below T 256 tokamax_xla stays (and the main job's numbers too).
  Without a causal mask or a window there is nothing to skip.
  """
  del backend
  if not request.causal and request.local_window is None:
    return "nothing to skip without causal or local_window (auto leaves it to dense kernels)"
  if request.q_len < BLOCKED_MIN_Q_LEN:
    return (f"q_len {request.q_len} < {BLOCKED_MIN_Q_LEN}: not measurably faster than dense"
            " kernels there (auto leaves it; name it to use it)")
  return None
