"""Every attention kernel as a record of what it accepts, and the order "auto" tries.

An `Implementation` names one adapter (`implementations`, `pallas`) with the
inputs it can take (platforms, dtypes, head_dim, sequence multiples, masks,
GQA); `check` says why a request cannot run on a backend. Hardware and version
rules that need more than these fields live in `rules`.

Example:
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((1, 16, 2, 8), (1, 16, 2, 8), "float32")
  >>> IMPLEMENTATIONS["cudnn"].check(request, Backend("cpu"), named=True)
  ('runs on gpu, not cpu', False)
  >>> PREFERENCE["cpu"]
  ('xla_blocked', 'tokamax_xla', 'xla', 'tokamax_xla_chunked')
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import types
from collections.abc import Callable, Mapping

import jax

from jax_ai_stack.kernels import implementations as impls
from jax_ai_stack.kernels import pallas, rules
from jax_ai_stack.kernels.names import AUTO, ImplementationName  # Also read as table.AUTO.
from jax_ai_stack.kernels.request import ALL_FLOATS, Backend, Request


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One attention kernel and the inputs it accepts."""

  name: str
  summary: str
  """What it calls, for the report."""
  run: Callable[..., jax.Array]
  """The adapter in `implementations` (see there for the signature)."""
  platforms: tuple[str, ...]
  """Where it runs natively."""
  interpret_platforms: tuple[str, ...] = ()
  """Where it runs in Pallas interpret mode (only when named explicitly)."""
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  head_dim_multiple: int = 1
  seq_multiple: int = 1
  """q_len and kv_len must be multiples of this (natively)."""
  interpret_seq_multiple: int | None = None
  """The same in interpret mode; None: as `seq_multiple`."""
  local_window: bool = True
  kv_seq_lengths: bool = True
  logits_soft_cap: bool = False
  """Takes `logits_soft_cap` (checked on CPU: the XLA kernels natively, the TPU splash
  kernels in Pallas interpret mode; the GPU ones stay off until a run there checks them)."""
  sinks: bool = False
  """Takes attention sinks (a logit per head in each softmax's denominator): the XLA
  adapter alone, as a plain softmax; the others' kernels have no such input."""
  chunked: bool = False
  """Takes chunked local attention (`Request.chunk_size`, Llama 4's): the XLA adapter alone,
  as a plain softmax with the chunk mask; the others' kernels have no such mask."""
  gqa: str = "native"
  """"native", or "repeat" (K/V heads are repeated to N before the kernel)."""
  nondeterministic: str | None = None
  """Why its gradients are not bitwise reproducible; None when they are."""
  extra_check: Callable[[Request, Backend], str | None] | None = None
  """Further rules (hardware generation, library version): a reason or None."""
  package: str = "jax"
  """The distribution that must be installed."""
  partitionable: bool = False
  """Plain XLA ops, which XLA's SPMD partitioner splits under a mesh; the others
  (custom calls) run per shard in `jax.shard_map` (`sharded.per_shard`)."""
  auto_check: Callable[[Request, Backend], str | None] | None = None
  """Why "auto" passes it over for a request it can run (another kernel is
  measured faster there): a reason or None. Not applied when named explicitly."""

  def _platform_check(self, backend: Backend, named: bool) -> tuple[str | None, bool]:
    """(reason it cannot run on this platform, or None; whether it would interpret)."""
    if backend.platform in self.platforms:
      return None, False
    if backend.platform not in self.interpret_platforms:
      return f"runs on {'/'.join(self.platforms)}, not {backend.platform}", False
    if not named:
      return (
          f"runs on {backend.platform} only in Pallas interpret mode (slow), used only"
          " when named explicitly", False,
      )
    return None, True

  def _input_check(self, request: Request, backend: Backend, interpret: bool) -> str | None:
    """Why the request's dtype, shapes or masks do not fit, or None."""
    if request.dtype not in self.dtypes:
      return f"dtype {request.dtype} not supported (supports {', '.join(self.dtypes)})"
    if backend.platform == "cpu" and request.dtype == "float16":
      # Fails only when compiling (XLA: "precision F16_F16_F32 is not supported
      # by dot_general on CPU"), so tracing cannot detect it: a rule instead.
      return "float16 attention does not compile on CPU (float16 dots with float32 accumulation)"
    if request.head_dim % self.head_dim_multiple:
      return f"head_dim {request.head_dim} must be a multiple of {self.head_dim_multiple}"
    multiple = self.seq_multiple
    if interpret and self.interpret_seq_multiple is not None:
      multiple = self.interpret_seq_multiple
    if request.q_len % multiple or request.kv_len % multiple:
      return f"q_len {request.q_len} and kv_len {request.kv_len} must be multiples of {multiple}"
    if request.local_window is not None and not self.local_window:
      return "local_window not supported"
    if request.kv_seq_lengths and not self.kv_seq_lengths:
      return "kv_seq_lengths not supported"
    if request.logits_soft_cap is not None and not self.logits_soft_cap:
      return "logits_soft_cap not supported"
    if request.sinks and not self.sinks:
      return "attention sinks not supported"
    if request.chunk_size is not None and not self.chunked:
      return "chunked attention (chunk_size) not supported"
    return None

  def check(self, request: Request, backend: Backend, *, named: bool) -> tuple[str | None, bool]:
    """(reason it cannot run, or None; whether it would run interpreted).

    `named`: the caller listed it explicitly; only then may Pallas interpret.
    """
    reason, interpret = self._platform_check(backend, named)
    if reason is None and self.package != "jax" and importlib.util.find_spec(self.package) is None:
      reason = f"{self.package} is not installed"
    reason = reason or self._input_check(request, backend, interpret)
    if reason is None and self.extra_check is not None:
      reason = self.extra_check(request, backend)
    if reason is None and not named and self.auto_check is not None:
      reason = self.auto_check(request, backend)
    return reason, interpret


def _tokamax(name: str) -> Callable[..., jax.Array]:
  return functools.partial(impls.tokamax_attention, implementation=name)


_IMPLEMENTATIONS = (
    Implementation(
        "xla", "jax.nn.dot_product_attention(implementation='xla')",
        functools.partial(impls.jax_nn, implementation="xla"),
        platforms=("cpu", "gpu", "tpu"), dtypes=ALL_FLOATS, partitionable=True, sinks=True,
        chunked=True,
    ),
    Implementation(
        "cudnn", "jax.nn.dot_product_attention(implementation='cudnn')",
        functools.partial(impls.jax_nn, implementation="cudnn"),
        platforms=("gpu",), dtypes=("bfloat16", "float16"), head_dim_multiple=8,
        nondeterministic=(
            "cuDNN's flash-attention backward, unless"
            " XLA_FLAGS=--xla_gpu_deterministic_ops=true"
        ),
        extra_check=rules.cudnn_check,
    ),
    Implementation(
        "tokamax_xla", "tokamax.dot_product_attention(implementation='xla')",
        _tokamax("xla"), platforms=("cpu", "gpu", "tpu"), dtypes=ALL_FLOATS, logits_soft_cap=True,
        extra_check=rules.tokamax_window_check, package="tokamax", partitionable=True,
    ),
    Implementation(
        "tokamax_xla_chunked", "tokamax.dot_product_attention(implementation='xla_chunked')",
        _tokamax("xla_chunked"), platforms=("cpu", "gpu", "tpu"), dtypes=ALL_FLOATS,
        logits_soft_cap=True,
        extra_check=rules.tokamax_window_check, package="tokamax", partitionable=True,
    ),
    Implementation(
        "xla_blocked", "jax_ai_stack.kernels.blocked (causal blocks skip masked keys)",
        impls.xla_blocked, platforms=("cpu", "gpu", "tpu"), dtypes=ALL_FLOATS,
        kv_seq_lengths=False, logits_soft_cap=True, sinks=True,
        auto_check=rules.blocked_auto_check,
        # Plain XLA, but its loop over (batch, head) slices is not something
        # the SPMD partitioner splits: under a mesh it runs per shard.
    ),
    Implementation(
        "tokamax_triton", "tokamax.dot_product_attention(implementation='triton')",
        _tokamax("triton"), platforms=("gpu",),
        extra_check=rules.tokamax_window_check, package="tokamax",
    ),
    Implementation(
        "tokamax_mosaic_gpu", "tokamax.dot_product_attention(implementation='mosaic_gpu')",
        _tokamax("mosaic_gpu"), platforms=("gpu",),
        extra_check=rules.mosaic_gpu_check, package="tokamax",
    ),
    Implementation(
        "tokamax_mosaic_tpu", "tokamax.dot_product_attention(implementation='mosaic_tpu')",
        _tokamax("mosaic_tpu"), platforms=("tpu",), dtypes=("float32", "bfloat16"),
        logits_soft_cap=True, extra_check=rules.mosaic_tpu_check, package="tokamax",
    ),
    Implementation(
        "pallas_gpu", "jax.experimental.pallas.ops.gpu.attention.mha (Triton)",
        pallas.pallas_gpu, platforms=("gpu",), interpret_platforms=("cpu",),
        seq_multiple=16, interpret_seq_multiple=1,
        local_window=False, kv_seq_lengths=False, gqa="repeat",
    ),
    Implementation(
        "pallas_tpu_flash", "jax.experimental.pallas.ops.tpu.flash_attention",
        pallas.pallas_tpu_flash, platforms=("tpu",), interpret_platforms=("cpu",),
        dtypes=("float32", "bfloat16"), seq_multiple=128,
        local_window=False, gqa="repeat",
    ),
    Implementation(
        "pallas_tpu_splash", "jax.experimental.pallas.ops.tpu.splash_attention",
        pallas.pallas_tpu_splash, platforms=("tpu",), interpret_platforms=("cpu",),
        dtypes=("float32", "bfloat16"), seq_multiple=128, logits_soft_cap=True, sinks=True,
    ),
)

IMPLEMENTATIONS: Mapping[str, Implementation] = types.MappingProxyType(
    {impl.name: impl for impl in _IMPLEMENTATIONS}
)
"""Every registered implementation by name (read-only).

Other modules read it as `table.IMPLEMENTATIONS` at call time, so that tests
can register stand-ins by patching this one attribute.
"""

PREFERENCE: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    # Measured (benchmarks/attention.py): the staircase of `blocked` beats
    # every dense kernel forward+backward on CPU from q_len 256 (its
    # `auto_check` says where not); tokamax's XLA attention matches a plain
    # softmax; jax.nn's is ~1.7x slower.
    "cpu": ("xla_blocked", "tokamax_xla", "xla", "tokamax_xla_chunked"),
    # Tokamax's own GPU order (Mosaic, then Triton), then cuDNN, which is
    # after them because its backward is nondeterministic by default.
    "gpu": (
        "tokamax_mosaic_gpu", "tokamax_triton", "cudnn", "pallas_gpu",
        "tokamax_xla", "xla", "tokamax_xla_chunked",
    ),
    # Tokamax's Mosaic kernel; JAX's splash and flash kernels where it lacks
    # a case (segment ids, older TPUs).
    "tpu": (
        "tokamax_mosaic_tpu", "pallas_tpu_splash", "pallas_tpu_flash",
        "tokamax_xla", "xla", "tokamax_xla_chunked",
    ),
})
"""The order "auto" tries, per platform."""
