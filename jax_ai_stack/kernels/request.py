"""What an attention call asks for, and the backend it would run on.

A `Request` holds everything kernel selection may look at: static shapes,
dtype and mask flags, never values, so it can be built from tracers and used
as a cache key. A `Backend` is the accelerator the capability rules check.

Example:
  >>> request = Request.from_shapes((2, 16, 4, 8), (2, 16, 2, 8), "bf16")
  >>> request.describe()
  'q [2,16,4,8] k/v [2,16,2,8] bfloat16, causal'
  >>> Request.from_dict(request.to_dict()) == request
  True
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

# Short dtype names accepted wherever a dtype is given as text.
_DTYPE_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
ALL_FLOATS = ("float32", "bfloat16", "float16", "float64")


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


def backend_of(device: Any) -> Backend:
  """The backend `device` is one of: an attached device, or a compile-only one of a chip
  this machine does not have (`jax_ai_stack.topology`)."""
  return Backend(
      platform=device.platform,
      device_kind=device.device_kind,
      compute_capability=getattr(device, "compute_capability", None),
  )


def current_backend() -> Backend:
  """The default JAX backend. Tests patch this to simulate GPU and TPU."""
  return backend_of(jax.devices()[0])


def target_backend() -> Backend:
  """The backend a kernel traced now is compiled for: the abstract mesh's device (a
  compile-only chip this machine lacks, `jax_ai_stack.topology`), else `current_backend()`."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return backend_of(device) if device is not None else current_backend()


def normalize_dtype(dtype: Any) -> str:
  """"bf16" / jnp.bfloat16 / np.dtype -> "bfloat16"; ValueError if not a float."""
  name = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
  try:
    name = jnp.dtype(name).name
  except TypeError:
    raise ValueError(
        f"dtype {dtype!r} is not a dtype name (try float32, bfloat16, float16)"
    ) from None
  if name not in ALL_FLOATS:
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


def _check_shapes(q_shape: tuple, k_shape: tuple) -> None:
  """ValueError naming the problem unless q [B, T, N, H] and k [B, S, K, H] fit."""
  for label, shape in (("q", q_shape), ("k", k_shape)):
    if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
      raise ValueError(
          f"{label} shape {shape} must be 4 positive ints ([B, T, N, H] / [B, S, K, H])"
      )
  if k_shape[0] != q_shape[0]:
    raise ValueError(f"batch of q {q_shape} and k {k_shape} differ")
  if k_shape[3] != q_shape[3]:
    raise ValueError(f"head_dim of q {q_shape} and k {k_shape} differ")
  if q_shape[2] % k_shape[2]:
    raise ValueError(
        f"num_kv_heads {k_shape[2]} (k {k_shape}) must divide num_heads {q_shape[2]} (q {q_shape})"
    )


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
  scale: float | None = None
  """The logits' scale; None: 1 / sqrt(head_dim)."""
  logits_soft_cap: float | None = None
  """Logits x become cap * tanh(x / cap) (Gemma 2); None: uncapped."""
  sinks: bool = False
  """The call passes attention sinks: a learned logit per query head that joins each
  softmax's denominator and weights no value (GPT-OSS)."""
  chunk_size: int | None = None
  """Chunked local attention (Llama 4's `attention_chunk_size` C): a query at position p sees
  only the keys of its chunk, positions C * (p // C) ... p; None: no chunks."""

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
      scale: float | None = None,
      logits_soft_cap: float | None = None,
      sinks: bool = False,
      chunk_size: int | None = None,
  ) -> Request:
    """Validates shapes (q [B, T, N, H], k/v [B, S, K, H]); ValueError names the problem.

    `segment_ids` and `kv_seq_lengths` are booleans: whether the call passes them.
    """
    q_shape, k_shape = _int_tuple(q_shape), _int_tuple(k_shape)
    _check_shapes(q_shape, k_shape)
    batch, q_len, num_heads, head_dim = q_shape
    kv_len, num_kv_heads = k_shape[1], k_shape[2]
    if segment_ids and q_len != kv_len:
      raise ValueError(
          f"segment_ids are for self-attention: q_len {q_len} must equal kv_len {kv_len}"
      )
    if local_window is not None and (
        isinstance(local_window, bool) or not isinstance(local_window, int) or local_window < 0
    ):
      raise ValueError(f"local_window {local_window!r} must be an int >= 0 or None")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
      raise ValueError(f"chunk_size {chunk_size!r} must be an int >= 1 or None")
    for name, value in (("scale", scale), ("logits_soft_cap", logits_soft_cap)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not value > 0):
        raise ValueError(f"{name} {value!r} must be a number > 0 or None")
    return cls(
        batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, normalize_dtype(dtype),
        bool(causal), bool(segment_ids), local_window, bool(kv_seq_lengths),
        None if scale is None else float(scale),
        None if logits_soft_cap is None else float(logits_soft_cap), bool(sinks), chunk_size,
    )

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Request:
    """The inverse of `to_dict`, validated as `from_shapes` (files and checkpoints are input)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, Mapping):
      raise ValueError(f"an attention request must be a mapping, got {type(data).__name__}")
    if unknown := sorted(set(data) - set(fields)):
      raise ValueError(f"attention request has unknown fields {unknown} (known: {fields})")
    if missing := [f for f in fields[:7] if f not in data]:
      raise ValueError(f"attention request lacks fields {missing}")
    d = data
    return cls.from_shapes(
        (d["batch"], d["q_len"], d["num_heads"], d["head_dim"]),
        (d["batch"], d["kv_len"], d["num_kv_heads"], d["head_dim"]),
        d["dtype"], causal=d.get("causal", True), segment_ids=d.get("segment_ids", False),
        local_window=d.get("local_window"), kv_seq_lengths=d.get("kv_seq_lengths", False),
        scale=d.get("scale"), logits_soft_cap=d.get("logits_soft_cap"),
        sinks=d.get("sinks", False), chunk_size=d.get("chunk_size"),
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
    if self.scale is not None:
      flags.append(f"scale={self.scale:g}")
    if self.logits_soft_cap is not None:
      flags.append(f"logits_soft_cap={self.logits_soft_cap:g}")
    if self.sinks:
      flags.append("sinks")
    if self.chunk_size is not None:
      flags.append(f"chunk_size={self.chunk_size}")
    shape = lambda s: "[" + ",".join(map(str, s)) + "]"
    return f"q {shape(self.q_shape)} k/v {shape(self.k_shape)} {self.dtype}, {', '.join(flags)}"

  def to_dict(self) -> dict:
    """JSON-ready; `from_dict` reads it back."""
    return dataclasses.asdict(self)
