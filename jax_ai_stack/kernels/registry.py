"""Which attention kernel runs where: capabilities, preference, fallback, report.

Every implementation is a named record of what it can do (platforms, dtypes,
head_dim, sequence multiples, masks, GQA). `select` turns a request (shapes,
dtype, masks) and the backend into a `Choice`: the first implementation in the
requested order whose checks pass and whose trace does not raise
`NotImplementedError` (the convention tokamax and JAX use for "not this
input"), together with the reason each other implementation was passed over.

The requested order is, first match wins:
  1. the `implementation` argument, unless it is "auto";
  2. the environment variable `JAX_AI_STACK_ATTENTION` (a name or a
     comma-separated list), so a user can force a kernel without code changes;
  3. a choice pinned by `load_autotune` for exactly this request;
  4. `PREFERENCE[platform]`.
"auto" inside a list stands for the platform's preference order. Pallas kernels
run on CPU in interpret mode (slow; for verification) only when named.

Selection depends only on shapes, dtype, flags and the platform, never on
values, so it works on tracers; choices are cached per request.

Example:
  >>> choice = select((2, 16, 4, 8), (2, 16, 2, 8), "float32", backend=Backend("cpu"))
  >>> choice.name
  'tokamax_xla'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.metadata
import importlib.util
import operator
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import implementations as impls

ENV_VAR = "JAX_AI_STACK_ATTENTION"
AUTO = "auto"

# Short dtype names accepted wherever a dtype is given as text.
_DTYPE_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
_ALL_FLOATS = ("float32", "bfloat16", "float16", "float64")


class NoImplementationError(NotImplementedError):
  """No attention implementation fits; the message names every rejection."""


@dataclasses.dataclass(frozen=True)
class Backend:
  """The accelerator a kernel would run on (what capability checks look at)."""

  platform: str
  """"cpu", "gpu" or "tpu" (as `jax.default_backend()`)."""
  device_kind: str = ""
  """E.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite", "cpu"."""
  compute_capability: str | None = None
  """CUDA compute capability such as "9.0"; None off NVIDIA GPUs."""

  def describe(self) -> str:
    extra = f", compute capability {self.compute_capability}" if self.compute_capability else ""
    kind = f" ({self.device_kind}{extra})" if self.device_kind else ""
    return f"{self.platform}{kind}"


def current_backend() -> Backend:
  """The default JAX backend. Tests patch this to simulate GPU and TPU."""
  device = jax.devices()[0]
  return Backend(
      platform=jax.default_backend(),
      device_kind=device.device_kind,
      compute_capability=getattr(device, "compute_capability", None),
  )


def normalize_dtype(dtype: Any) -> str:
  """"bf16" / jnp.bfloat16 / np.dtype -> "bfloat16"; ValueError if not a float."""
  name = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
  try:
    name = jnp.dtype(name).name
  except TypeError:
    raise ValueError(
        f"dtype {dtype!r} is not a dtype name (try float32, bfloat16, float16)"
    ) from None
  if name not in _ALL_FLOATS:
    raise ValueError(f"dtype {name} is not a floating dtype (try float32, bfloat16, float16)")
  return name


def _int_tuple(shape: Sequence[Any]) -> tuple:
  """Shape entries as Python ints where they are integers (NumPy ones too)."""
  out = []
  for d in shape:
    try:
      out.append(operator.index(d))
    except TypeError:
      out.append(d)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Request:
  """Everything selection may look at: static shapes, dtype and mask flags."""

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  causal: bool = True
  segment_ids: bool = False
  local_window: int | None = None
  kv_seq_lengths: bool = False

  @classmethod
  def from_shapes(
      cls,
      q_shape: Sequence[int],
      k_shape: Sequence[int],
      dtype: Any,
      *,
      causal: bool = True,
      segment_ids: bool = False,
      local_window: int | None = None,
      kv_seq_lengths: bool = False,
  ) -> Request:
    """Validates shapes (q [B, T, N, H], k/v [B, S, K, H]); ValueError names the problem."""
    q_shape, k_shape = _int_tuple(q_shape), _int_tuple(k_shape)
    for label, shape in (("q", q_shape), ("k", k_shape)):
      if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(
            f"{label} shape {shape} must be 4 positive ints ([B, T, N, H] / [B, S, K, H])"
        )
    batch, q_len, num_heads, head_dim = q_shape
    k_batch, kv_len, num_kv_heads, k_head_dim = k_shape
    if k_batch != batch:
      raise ValueError(f"batch of q {q_shape} and k {k_shape} differ")
    if k_head_dim != head_dim:
      raise ValueError(f"head_dim of q {q_shape} and k {k_shape} differ")
    if num_heads % num_kv_heads:
      raise ValueError(
          f"num_kv_heads {num_kv_heads} (k {k_shape}) must divide"
          f" num_heads {num_heads} (q {q_shape})"
      )
    if segment_ids and q_len != kv_len:
      raise ValueError(
          f"segment_ids are for self-attention: q_len {q_len} must equal kv_len {kv_len}"
      )
    if local_window is not None and (
        isinstance(local_window, bool) or not isinstance(local_window, int) or local_window < 0
    ):
      raise ValueError(f"local_window {local_window!r} must be an int >= 0 or None")
    return cls(
        batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, normalize_dtype(dtype),
        bool(causal), bool(segment_ids), local_window, bool(kv_seq_lengths),
    )

  @property
  def q_shape(self) -> tuple[int, ...]:
    return (self.batch, self.q_len, self.num_heads, self.head_dim)

  @property
  def k_shape(self) -> tuple[int, ...]:
    return (self.batch, self.kv_len, self.num_kv_heads, self.head_dim)

  def describe(self) -> str:
    flags = ["causal" if self.causal else "not causal"]
    if self.segment_ids:
      flags.append("segment_ids")
    if self.local_window is not None:
      flags.append(f"local_window={self.local_window}")
    if self.kv_seq_lengths:
      flags.append("kv_seq_lengths")
    shape = lambda s: "[" + ",".join(map(str, s)) + "]"
    return f"q {shape(self.q_shape)} k/v {shape(self.k_shape)} {self.dtype}, {', '.join(flags)}"

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


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
  gqa: str = "native"
  """"native", or "repeat" (K/V heads are repeated to N before the kernel)."""
  nondeterministic: str | None = None
  """Why its gradients are not bitwise reproducible; None when they are."""
  extra_check: Callable[[Request, Backend], str | None] | None = None
  """Further rules (hardware generation, library version): a reason or None."""
  package: str = "jax"
  """The distribution that must be installed."""

  def check(self, request: Request, backend: Backend, *, named: bool) -> tuple[str | None, bool]:
    """(reason it cannot run, or None; whether it would run interpreted)."""
    interpret = False
    if backend.platform not in self.platforms:
      if backend.platform not in self.interpret_platforms:
        return f"runs on {'/'.join(self.platforms)}, not {backend.platform}", False
      if not named:
        return (
            f"runs on {backend.platform} only in Pallas interpret mode (slow), used only"
            " when named explicitly", False,
        )
      interpret = True
    if self.package != "jax" and importlib.util.find_spec(self.package) is None:
      return f"{self.package} is not installed", interpret
    if request.dtype not in self.dtypes:
      return f"dtype {request.dtype} not supported (supports {', '.join(self.dtypes)})", interpret
    if backend.platform == "cpu" and request.dtype == "float16":
      # Fails only when compiling (XLA: "precision F16_F16_F32 is not supported
      # by dot_general on CPU"), so tracing cannot detect it: a rule instead.
      return (
          "float16 attention does not compile on CPU (float16 dots with float32"
          " accumulation)", interpret,
      )
    if request.head_dim % self.head_dim_multiple:
      multiple = self.head_dim_multiple
      return f"head_dim {request.head_dim} must be a multiple of {multiple}", interpret
    multiple = self.seq_multiple
    if interpret and self.interpret_seq_multiple is not None:
      multiple = self.interpret_seq_multiple
    if request.q_len % multiple or request.kv_len % multiple:
      return (
          f"q_len {request.q_len} and kv_len {request.kv_len} must be multiples of {multiple}",
          interpret,
      )
    if request.local_window is not None and not self.local_window:
      return "local_window not supported", interpret
    if request.kv_seq_lengths and not self.kv_seq_lengths:
      return "kv_seq_lengths not supported", interpret
    if self.extra_check is not None and (reason := self.extra_check(request, backend)):
      return reason, interpret
    return None, interpret


# ---- hardware and version rules that do not fit the common fields ----------


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def _tokamax_version() -> tuple[int, ...]:
  try:
    return _version_tuple(importlib.metadata.version("tokamax"))
  except importlib.metadata.PackageNotFoundError:
    return ()


def _tokamax_window_check(request: Request, backend: Backend) -> str | None:
  del backend
  if request.local_window is not None and request.q_len != request.kv_len:
    if _tokamax_version() and _tokamax_version() < (0, 0, 17):
      # 0.0.12 builds the window from key positions and fails when T != S.
      return "local_window with q_len != kv_len needs tokamax >= 0.0.17"
  return None


def _compute_capability(backend: Backend) -> float | None:
  try:
    return float(backend.compute_capability) if backend.compute_capability else None
  except ValueError:
    return None


def _cudnn_check(request: Request, backend: Backend) -> str | None:
  capability = _compute_capability(backend)
  if capability is None:  # Only CUDA devices report an "X.Y" compute capability.
    return (f"cuDNN needs an NVIDIA GPU reporting a CUDA compute capability "
            f"(device: {backend.device_kind or 'unknown'}, none reported)")
  max_head_dim = 256 if capability >= 9.0 else 128
  if request.head_dim > max_head_dim:
    return f"head_dim {request.head_dim} > {max_head_dim} (cuDNN limit on this GPU)"
  return None


def _mosaic_gpu_check(request: Request, backend: Backend) -> str | None:
  return _tokamax_window_check(request, backend) or (
      None if (_compute_capability(backend) or 0.0) >= 8.0
      else f"Mosaic GPU needs compute capability >= 8.0 (device reports {backend.compute_capability or 'none'})"
  )


def _tpu_generation(backend: Backend) -> int | None:
  match = re.search(r"TPU\s*v?(\d+)", backend.device_kind, re.IGNORECASE)
  return int(match.group(1)) if match else None


def _mosaic_tpu_check(request: Request, backend: Backend) -> str | None:
  generation = _tpu_generation(backend)
  if generation is not None and generation < 5:
    return f"tokamax's Mosaic TPU kernel needs TPU v5 or newer (device: {backend.device_kind})"
  return _tokamax_window_check(request, backend)


def _tokamax(name: str) -> Callable[..., jax.Array]:
  return functools.partial(impls.tokamax_attention, implementation=name)


_FLASH_MASKS = "Pallas flash kernels need 128-aligned sequence tiles"

_IMPLEMENTATIONS = (
    Implementation(
        "xla", "jax.nn.dot_product_attention(implementation='xla')",
        functools.partial(impls.jax_nn, implementation="xla"),
        platforms=("cpu", "gpu", "tpu"), dtypes=_ALL_FLOATS,
    ),
    Implementation(
        "cudnn", "jax.nn.dot_product_attention(implementation='cudnn')",
        functools.partial(impls.jax_nn, implementation="cudnn"),
        platforms=("gpu",), dtypes=("bfloat16", "float16"), head_dim_multiple=8,
        nondeterministic=(
            "cuDNN's flash-attention backward, unless"
            " XLA_FLAGS=--xla_gpu_deterministic_ops=true"
        ),
        extra_check=_cudnn_check,
    ),
    Implementation(
        "tokamax_xla", "tokamax.dot_product_attention(implementation='xla')",
        _tokamax("xla"), platforms=("cpu", "gpu", "tpu"), dtypes=_ALL_FLOATS,
        extra_check=_tokamax_window_check, package="tokamax",
    ),
    Implementation(
        "tokamax_xla_chunked", "tokamax.dot_product_attention(implementation='xla_chunked')",
        _tokamax("xla_chunked"), platforms=("cpu", "gpu", "tpu"), dtypes=_ALL_FLOATS,
        extra_check=_tokamax_window_check, package="tokamax",
    ),
    Implementation(
        "tokamax_triton", "tokamax.dot_product_attention(implementation='triton')",
        _tokamax("triton"), platforms=("gpu",),
        extra_check=_tokamax_window_check, package="tokamax",
    ),
    Implementation(
        "tokamax_mosaic_gpu", "tokamax.dot_product_attention(implementation='mosaic_gpu')",
        _tokamax("mosaic_gpu"), platforms=("gpu",),
        extra_check=_mosaic_gpu_check, package="tokamax",
    ),
    Implementation(
        "tokamax_mosaic_tpu", "tokamax.dot_product_attention(implementation='mosaic_tpu')",
        _tokamax("mosaic_tpu"), platforms=("tpu",), dtypes=("float32", "bfloat16"),
        extra_check=_mosaic_tpu_check, package="tokamax",
    ),
    Implementation(
        "pallas_gpu", "jax.experimental.pallas.ops.gpu.attention.mha (Triton)",
        impls.pallas_gpu, platforms=("gpu",), interpret_platforms=("cpu",),
        seq_multiple=16, interpret_seq_multiple=1,
        local_window=False, kv_seq_lengths=False, gqa="repeat",
    ),
    Implementation(
        "pallas_tpu_flash", "jax.experimental.pallas.ops.tpu.flash_attention",
        impls.pallas_tpu_flash, platforms=("tpu",), interpret_platforms=("cpu",),
        dtypes=("float32", "bfloat16"), seq_multiple=128,
        local_window=False, gqa="repeat",
    ),
    Implementation(
        "pallas_tpu_splash", "jax.experimental.pallas.ops.tpu.splash_attention",
        impls.pallas_tpu_splash, platforms=("tpu",), interpret_platforms=("cpu",),
        dtypes=("float32", "bfloat16"), seq_multiple=128,
    ),
)

IMPLEMENTATIONS: Mapping[str, Implementation] = types.MappingProxyType(
    {impl.name: impl for impl in _IMPLEMENTATIONS}
)
"""Every registered implementation by name (read-only)."""

PREFERENCE: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    # Measured (benchmarks/attention.py): tokamax's XLA attention matches a
    # plain softmax on CPU; jax.nn's is ~1.7x slower forward+backward.
    "cpu": ("tokamax_xla", "xla", "tokamax_xla_chunked"),
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


def parse_implementation(
    spec: str | Sequence[str], *, origin: str = "implementation"
) -> tuple[str, ...]:
  """"auto" / "a,b" / ["a", "b"] -> names; ValueError names `origin` and the bad name."""
  names = spec.split(",") if isinstance(spec, str) else list(spec)
  names = tuple(n.strip() for n in names if isinstance(n, str) and n.strip())
  if not names:
    raise ValueError(f"{origin} {spec!r} names no attention implementation")
  for name in names:
    if name != AUTO and name not in IMPLEMENTATIONS:
      raise ValueError(
          f"{origin}: unknown attention implementation {name!r}; known: {AUTO}, "
          + ", ".join(IMPLEMENTATIONS)
      )
  return names


# ---- pinned choices (autotune files) ---------------------------------------

_PINS: contextvars.ContextVar[tuple[tuple[Mapping[Request, str], str], ...]] = (
    contextvars.ContextVar("jax_ai_stack_attention_pins", default=())
)


@contextlib.contextmanager
def pinned(choices: Mapping[Request, str], source: str) -> Iterator[None]:
  """Within the block, "auto" uses `choices[request]` where present.

  `source` names where the pins came from (an autotune file), for reports.
  The innermost block wins.
  """
  token = _PINS.set(_PINS.get() + ((dict(choices), source),))
  try:
    yield
  finally:
    _PINS.reset(token)


def _pin_for(request: Request) -> tuple[str, str] | None:
  for choices, source in reversed(_PINS.get()):
    if request in choices:
      return choices[request], source
  return None


def _resolve(implementation: str | Sequence[str], request: Request, platform: str):
  """(names in order, names given explicitly, where the order came from)."""
  names = parse_implementation(implementation)
  origin = "argument implementation"
  if names == (AUTO,):
    env = os.environ.get(ENV_VAR, "").strip()
    pin = _pin_for(request)
    if env:
      origin = f"environment {ENV_VAR}"
      names = parse_implementation(env, origin=origin)
    elif pin is not None:
      names, origin = (pin[0],), f"pinned by {pin[1]}"
    else:
      origin = f"auto: the {platform} preference order"
  explicit = tuple(n for n in names if n != AUTO)
  order: list[str] = []
  for name in names:
    for expanded in (PREFERENCE.get(platform, ("xla",)) if name == AUTO else (name,)):
      if expanded not in order:
        order.append(expanded)
  return tuple(order), explicit, origin


# ---- the choice and its report ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What selection concluded about one implementation."""

  name: str
  status: str
  """"chosen", "eligible" (would be a fallback), "rejected" or "not in order"."""
  reason: str = ""
  interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation selected for a request on a backend, and why."""

  name: str | None
  """The implementation that runs; None only from `report` when none fits."""
  request: Request
  backend: Backend
  source: str
  """Where the order came from: argument, environment, autotune file, auto."""
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
    return self.name is not None and _nondeterminism(self.name) is None

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
            {**dataclasses.asdict(v), "calls": IMPLEMENTATIONS[v.name].summary}
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
    lines.append("")
    width = max(len(n) for n in IMPLEMENTATIONS)
    lines.append(f"  {'implementation':<{width}}  {'eligible':<8}  why not / notes")
    for v in self.verdicts:
      eligible = "yes" if v.status in ("chosen", "eligible") else "no"
      notes = [v.reason] if v.reason else []
      if eligible == "yes":
        if v.interpret:
          notes.append("Pallas interpret mode (slow)")
        if traits := _traits(v.name):
          notes.append(traits)
      mark = "*" if v.status == "chosen" else " "
      lines.append(f"{mark} {v.name:<{width}}  {eligible:<8}  {'; '.join(notes)}".rstrip())
    lines.append("")
    if self.name is None:
      lines.append("Chosen: none fits")
    else:
      determinism = "deterministic" if self.deterministic else (
          f"NONDETERMINISTIC: {_nondeterminism(self.name)}")
      how = " in Pallas interpret mode" if self.interpret else ""
      lines.append(f"Chosen: {self.name}{how} ({determinism})")
    return "\n".join(lines)


def _nondeterminism(name: str) -> str | None:
  """Why `name`'s gradients are not bitwise reproducible here, or None."""
  # XLA makes cuDNN use its deterministic backward under this flag.
  if name == "cudnn" and "--xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", ""):
    return None
  return IMPLEMENTATIONS[name].nondeterministic


def _traits(name: str) -> str:
  impl = IMPLEMENTATIONS[name]
  notes = ["GQA by repeating K/V heads"] if impl.gqa == "repeat" else []
  if why := _nondeterminism(name):
    notes.append(f"nondeterministic: {why}")
  return "; ".join(notes)


def _probe(impl: Implementation, request: Request, interpret: bool) -> str | None:
  """Traces forward+backward abstractly; the reason if the kernel refuses."""
  dtype = jnp.dtype(request.dtype)
  q = jax.ShapeDtypeStruct(request.q_shape, dtype)
  k = jax.ShapeDtypeStruct(request.k_shape, dtype)
  ids = None
  if request.segment_ids:
    ids = jax.ShapeDtypeStruct((request.batch, request.q_len), jnp.int32)
  lengths = jax.ShapeDtypeStruct((request.batch,), jnp.int32) if request.kv_seq_lengths else None
  scale = request.head_dim ** -0.5

  def loss(q, k, v, ids, lengths):
    out = impl.run(
        q, k, v, causal=request.causal, segment_ids=ids, scale=scale,
        local_window=request.local_window, kv_seq_lengths=lengths, interpret=interpret,
    )
    return jnp.sum(out.astype(jnp.float32))

  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, ids, lengths)
  except (NotImplementedError, ValueError) as e:  # How kernels refuse inputs.
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__} when traced: {first_line[:200]}"
  return None


@functools.lru_cache(maxsize=512)
def _decide(
    request: Request,
    backend: Backend,
    order: tuple[str, ...],
    explicit: tuple[str, ...],
    source: str,
    probe: str,
) -> Choice:
  """probe: "none", "first" (until one passes) or "all" (for reports)."""
  verdicts: list[Verdict] = []
  chosen = None
  for name in order:
    impl = IMPLEMENTATIONS[name]
    reason, interpret = impl.check(request, backend, named=name in explicit)
    if reason is None and probe != "none" and (chosen is None or probe == "all"):
      reason = _probe(impl, request, interpret)
    if reason is not None:
      verdicts.append(Verdict(name, "rejected", reason, interpret))
    elif chosen is None:
      chosen = name
      verdicts.append(Verdict(name, "chosen", "", interpret))
    else:
      verdicts.append(Verdict(name, "eligible", "", interpret))
  for name, impl in IMPLEMENTATIONS.items():
    if name not in order:
      reason, _ = impl.check(request, backend, named=False)
      verdicts.append(Verdict(name, "not in order", reason or f"not in the order ({source})"))
  return Choice(chosen, request, backend, source, order, tuple(verdicts), probe != "none")


def _choose(
    q_shape, k_shape, dtype, *, causal, segment_ids, local_window, kv_seq_lengths,
    implementation, backend, probe,
) -> Choice:
  request = Request.from_shapes(
      q_shape, k_shape, dtype, causal=causal, segment_ids=segment_ids,
      local_window=local_window, kv_seq_lengths=kv_seq_lengths,
  )
  backend = backend or current_backend()
  order, explicit, source = _resolve(implementation, request, backend.platform)
  return _decide(request, backend, order, explicit, source, probe)


def _probe_mode(backend: Backend | None, probe: bool | None) -> bool:
  if probe is None:  # Tracing needs the real platform; a simulated one cannot.
    return backend is None and current_backend().platform == jax.default_backend()
  return probe


def select(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    dtype: Any,
    *,
    causal: bool = True,
    segment_ids: bool = False,
    local_window: int | None = None,
    kv_seq_lengths: bool = False,
    implementation: str | Sequence[str] = AUTO,
    backend: Backend | None = None,
    probe: bool | None = None,
) -> Choice:
  """The implementation `attention` uses for these shapes, and why.

  Args:
    q_shape: [B, T, N, H]. k_shape: [B, S, K, H] (v has the same shape).
    dtype: of q, k, v (a dtype or a name such as "bf16").
    causal, segment_ids, local_window, kv_seq_lengths: the masks `attention`
      gets (segment_ids and kv_seq_lengths as booleans: given or not).
    implementation: "auto", a name, a comma-separated list or a sequence.
    backend: the backend to select for; default: the current one.
    probe: trace candidates abstractly (`jax.eval_shape` of forward and
      backward) to skip those raising NotImplementedError. Default: only when
      selecting for the real backend.

  Returns:
    A `Choice` naming the implementation.

  Raises:
    NoImplementationError: none fits; the message lists every rejection.
    ValueError: bad shapes, dtype or implementation name.
  """
  probe = "first" if _probe_mode(backend, probe) else "none"
  choice = _choose(
      q_shape, k_shape, dtype, causal=causal, segment_ids=segment_ids,
      local_window=local_window, kv_seq_lengths=kv_seq_lengths,
      implementation=implementation, backend=backend, probe=probe,
  )
  if choice.name is None:
    rejections = "; ".join(
        f"{v.name}: {v.reason}" for v in choice.verdicts if v.name in choice.order
    )
    raise NoImplementationError(
        f"no attention implementation fits {choice.request.describe()} on"
        f" {choice.backend.describe()} (order from {choice.source}): {rejections}"
    )
  return choice


def report(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    dtype: Any,
    *,
    causal: bool = True,
    segment_ids: bool = False,
    local_window: int | None = None,
    kv_seq_lengths: bool = False,
    implementation: str | Sequence[str] = AUTO,
    backend: Backend | None = None,
    probe: bool | None = None,
) -> Choice:
  """Like `select`, but probes every candidate and never raises for no fit."""
  probe = "all" if _probe_mode(backend, probe) else "none"
  return _choose(
      q_shape, k_shape, dtype, causal=causal, segment_ids=segment_ids,
      local_window=local_window, kv_seq_lengths=kv_seq_lengths,
      implementation=implementation, backend=backend, probe=probe,
  )


def clear_cache() -> None:
  """Forgets cached choices (after changing the registry in tests)."""
  _decide.cache_clear()
