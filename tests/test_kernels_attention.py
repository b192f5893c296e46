"""Every attention kernel that runs on this CPU, checked against a plain softmax.

Natively on CPU: `xla`, `tokamax_xla`, `tokamax_xla_chunked`. In Pallas
interpret mode: `pallas_gpu`, `pallas_tpu_flash`, `pallas_tpu_splash`, and
tokamax's Mosaic TPU kernel where this tokamax lets it skip its device check.
Not runnable here (GPU/TPU only, and tokamax has no interpret switch):
`cudnn`, `tokamax_triton`, `tokamax_mosaic_gpu`; their selection logic is
tested in test_kernels_selection.py.

Forward outputs and gradients (VJP with a random cotangent) are compared to
`reference_attention` below. Tolerance: max |actual - expected| divided by
max(1, max |expected|):
  float32  5e-5  (reference in float32 at HIGHEST precision)
  bfloat16 4e-2  (inputs rounded to bf16 first; ~3 significant digits)
float16 does not compile on XLA:CPU for these kernels; that refusal is tested.
Interpret mode is slow, so its shapes are the smallest each kernel accepts.
"""

from __future__ import annotations

import dataclasses
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels import implementations, rules

TOLERANCE = {"float32": 5e-5, "bfloat16": 4e-2}


def reference_attention(q, k, v, *, causal, segment_ids=None, local_window=None, kv_seq_lengths=None,
                        logits_soft_cap=None):
  """Softmax(q k^T / sqrt(H) + mask) v, written out in float32; masks and soft cap as
  documented."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  _, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / np.sqrt(head_dim)
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  i = np.arange(q_len)[:, None]
  j = np.arange(kv_len)[None, :]
  allowed = np.ones((1, 1, q_len, kv_len), bool)
  if causal:
    allowed = allowed & (j <= i)
  if local_window is not None:
    allowed = allowed & (j >= i - local_window) & (j <= i)
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  if kv_seq_lengths is not None:
    allowed = allowed & (j < kv_seq_lengths[:, None, None, None])
  logits = jnp.where(allowed, logits, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v, precision="highest")


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem. No row is fully masked (softmax of nothing is undefined)."""

  name: str
  batch: int = 2
  q_len: int = 16
  kv_len: int | None = None
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 8
  causal: bool = True
  segment_ids: bool = False
  local_window: int | None = None
  kv_seq_lengths: tuple[int, ...] | None = None
  logits_soft_cap: float | None = None

  def inputs(self, dtype):
    kv_len = self.kv_len or self.q_len
    keys = jax.random.split(jax.random.key(zlib.crc32(self.name.encode())), 4)
    q = jax.random.normal(keys[0], (self.batch, self.q_len, self.heads, self.head_dim), dtype)
    k = jax.random.normal(keys[1], (self.batch, kv_len, self.kv_heads, self.head_dim), dtype)
    v = jax.random.normal(keys[2], (self.batch, kv_len, self.kv_heads, self.head_dim), dtype)
    cotangent = jax.random.normal(keys[3], q.shape[:3] + (self.head_dim,), jnp.float32)
    segment_ids = None
    if self.segment_ids:  # Three packed documents of different lengths per row, 0 included.
      cuts = np.array([self.q_len * 5 // 16, self.q_len * 11 // 16])
      row = np.searchsorted(cuts, np.arange(self.q_len), side="right")
      segment_ids = jnp.asarray(np.stack([row, (row + 1) % 3][: self.batch]), jnp.int32)
    lengths = None if self.kv_seq_lengths is None else jnp.asarray(self.kv_seq_lengths, jnp.int32)
    return q, k, v, segment_ids, lengths, cotangent

  def masks(self):
    return dict(causal=self.causal, segment_ids=self.segment_ids,
                local_window=self.local_window, kv_seq_lengths=self.kv_seq_lengths is not None,
                logits_soft_cap=self.logits_soft_cap)


CASES = {
    c.name: c
    for c in (
        Case("packed_causal_gqa", segment_ids=True),
        Case("bidirectional_mqa_segments", kv_heads=1, causal=False, segment_ids=True),
        Case("decode_one_token", q_len=1, kv_len=16, causal=False, kv_seq_lengths=(16, 9)),
        Case("prefill_into_cache", q_len=8, kv_len=16, causal=True, kv_seq_lengths=(16, 12)),
        Case("local_window", local_window=3),
        Case("local_window_shorter_queries", q_len=8, kv_len=16, local_window=3),
    )
}

NATIVE = ("xla", "tokamax_xla", "tokamax_xla_chunked")


def _tokamax_version():
  return rules.tokamax_version()


def tokamax_version_text():
  return ".".join(map(str, _tokamax_version()))


def _expected_refusal(name: str, case: Case) -> str | None:
  """What selection must say when it turns a (kernel, case) down; None: must run."""
  if (name.startswith("tokamax_") and case.local_window is not None
      and (case.kv_len or case.q_len) != case.q_len and _tokamax_version() < (0, 0, 17)):
    return "needs tokamax >= 0.0.17"
  return None


def check_against_reference(name: str, case: Case, dtype: str = "float32") -> None:
  q, k, v, segment_ids, lengths, cotangent = case.inputs(jnp.dtype(dtype))

  def run(q, k, v):
    return kernels.attention(
        q, k, v, causal=case.causal, segment_ids=segment_ids, local_window=case.local_window,
        kv_seq_lengths=lengths, logits_soft_cap=case.logits_soft_cap, implementation=name,
    )

  def reference(q, k, v):
    return reference_attention(
        q, k, v, causal=case.causal, segment_ids=segment_ids,
        local_window=case.local_window, kv_seq_lengths=lengths,
        logits_soft_cap=case.logits_soft_cap,
    )

  def forward_and_grads(f):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cotangent.astype(out.dtype))

  # One compiled program for both: compiling dominates at these sizes.
  (out, grads), (expected_out, expected_grads) = jax.jit(
      lambda: (forward_and_grads(run), forward_and_grads(reference)))()
  assert out.shape == q.shape and out.dtype == q.dtype
  tol = TOLERANCE[dtype]
  for label, actual, expected in zip(
      ("output", "dq", "dk", "dv"), (out, *grads), (expected_out, *expected_grads)
  ):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.all(np.isfinite(actual)), f"{name} {case.name}: {label} has non-finite values"
    error = np.max(np.abs(actual - expected)) / max(1.0, np.max(np.abs(expected)))
    assert error <= tol, f"{name} {case.name} {dtype}: {label} error {error:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("name", NATIVE)
def test_native_kernel_matches_reference_float32(name, case):
  if refusal := _expected_refusal(name, case):
    with pytest.raises(kernels.NoImplementationError, match=refusal.replace(".", r"\.")):
      kernels.select(kernels.Request.from_shapes(*_shapes(case), "float32", **case.masks()), name)
    return
  check_against_reference(name, case)


@pytest.mark.parametrize("name", NATIVE)
def test_native_kernel_matches_reference_bfloat16(name):
  check_against_reference(name, Case("causal_gqa"), "bfloat16")


@pytest.mark.parametrize("name", NATIVE)
def test_float16_is_refused_on_cpu_with_the_reason(name):
  # XLA:CPU cannot compile float16 dots accumulating in float32, which these
  # kernels use; the failure would only show when compiling, so it is a rule.
  with pytest.raises(kernels.NoImplementationError, match=f"{name}: float16 .* CPU"):
    kernels.select(kernels.Request.from_shapes((1, 16, 2, 8), (1, 16, 2, 8), "float16"), name)


def _shapes(case: Case):
  kv_len = case.kv_len or case.q_len
  return ((case.batch, case.q_len, case.heads, case.head_dim),
          (case.batch, kv_len, case.kv_heads, case.head_dim))


# Interpret mode: the GPU kernel takes any length (blocks shrink to fit); the
# TPU kernels need 128-long sequence tiles even when interpreted.
INTERPRETED = [
    ("pallas_gpu", Case("packed_causal_gqa", batch=1, q_len=32, segment_ids=True)),
    ("pallas_gpu", Case("bidirectional", batch=1, q_len=32, heads=2, kv_heads=2, causal=False)),
    ("pallas_tpu_flash", Case("packed_causal_gqa_lengths", q_len=128, heads=2, kv_heads=1,
                              segment_ids=True, kv_seq_lengths=(128, 120))),
    ("pallas_tpu_splash", Case("packed_causal_gqa_lengths", q_len=128, heads=2, kv_heads=1,
                               segment_ids=True, kv_seq_lengths=(128, 120))),
    ("pallas_tpu_splash", Case("local_window_bidirectional", batch=1, q_len=128, heads=2,
                               kv_heads=2, causal=False, local_window=5)),
    # Gemma 2's sliding layers: a window and a soft cap (small, so that it bites).
    ("pallas_tpu_splash", Case("soft_cap_local_window", batch=1, q_len=128, heads=2,
                               kv_heads=1, local_window=31, logits_soft_cap=1.5)),
]


@pytest.mark.parametrize(
    "name,case", INTERPRETED, ids=[f"{n}-{c.name}" for n, c in INTERPRETED]
)
def test_pallas_kernel_in_interpret_mode_matches_reference(name, case):
  choice = kernels.select(kernels.Request.from_shapes(*_shapes(case), "float32", **case.masks()), name)
  assert (choice.name, choice.interpret) == (name, True)
  check_against_reference(name, case)


@pytest.mark.parametrize("name,masks", [
    ("pallas_gpu", dict(local_window=3)),
    ("pallas_gpu", dict(kv_seq_lengths=True)),
    ("pallas_tpu_flash", dict(local_window=3)),
])
def test_pallas_kernels_refuse_masks_they_lack(name, masks):
  with pytest.raises(kernels.NoImplementationError, match=f"{name}: .*not supported"):
    kernels.select(kernels.Request.from_shapes((1, 128, 2, 8), (1, 128, 2, 8), "float32", **masks), name)


@pytest.mark.cpu_backend
@pytest.mark.parametrize("cap", [None, 1.5])
def test_tokamax_mosaic_tpu_kernel_in_tpu_interpret_mode(monkeypatch, cap):
  """tokamax's TPU kernel, via our adapter, on CPU: tokamax has no interpret
  switch, but its op objects can skip their device check, and Pallas TPU
  interpret mode then runs the kernel on CPU. With Gemma 2's soft cap too."""
  from jax.experimental.pallas import tpu as pltpu

  tokamax_api = importlib.import_module("tokamax._src.ops.attention.api")
  op = tokamax_api.IMPLEMENTATIONS["mosaic_tpu"]
  fields = lambda obj: {f.name for f in dataclasses.fields(obj)}
  if "bypass_device_check" not in fields(op) or (
      op.vjp is not None and "bypass_device_check" not in fields(op.vjp)):
    pytest.skip(f"tokamax {tokamax_version_text()}'s Mosaic TPU op cannot skip its device check")
  vjp = op.vjp and dataclasses.replace(op.vjp, bypass_device_check=True)
  on_cpu = dataclasses.replace(op, bypass_device_check=True, vjp=vjp)
  monkeypatch.setattr(tokamax_api, "IMPLEMENTATIONS", {**tokamax_api.IMPLEMENTATIONS, "mosaic_tpu": on_cpu})

  case = Case("causal_gqa", batch=1, q_len=128, heads=2, kv_heads=1, head_dim=8)
  q, k, v, _, _, cotangent = case.inputs(jnp.float32)
  run = lambda q, k, v: implementations.tokamax_attention(
      q, k, v, causal=True, segment_ids=None, scale=case.head_dim ** -0.5, local_window=None,
      kv_seq_lengths=None, interpret=True, implementation="mosaic_tpu", logits_soft_cap=cap)
  with pltpu.force_tpu_interpret_mode():
    out, vjp_fn = jax.vjp(run, q, k, v)
    grads = vjp_fn(cotangent)
  expected, expected_vjp = jax.vjp(
      lambda *a: reference_attention(*a, causal=True, logits_soft_cap=cap), q, k, v)
  for actual, wanted in zip((out, *grads), (expected, *expected_vjp(cotangent))):
    error = np.max(np.abs(actual - wanted)) / max(1.0, np.max(np.abs(wanted)))
    assert error <= TOLERANCE["float32"]


def test_auto_under_jit_grad_and_remat_matches_reference(capsys):
  case = CASES["packed_causal_gqa"]
  q, k, v, segment_ids, _, _ = case.inputs(jnp.float32)
  layer = jax.checkpoint(lambda q, k, v: kernels.attention(q, k, v, segment_ids=segment_ids))
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(q, k, v)
  expected = jax.grad(loss(lambda *a: reference_attention(*a, causal=True, segment_ids=segment_ids)),
                      argnums=(0, 1, 2))(q, k, v)
  for actual, wanted in zip(grads, expected):
    np.testing.assert_allclose(actual, wanted, atol=5e-5)
  jax.jit(lambda q, k, v: kernels.attention(q, k, v, segment_ids=segment_ids))(q, k, v)
  assert capsys.readouterr().out == ""  # Selection logs nothing per call.


def test_vmapped_call_selects_on_the_unbatched_shape():
  q = jnp.ones((3, 2, 16, 4, 8))
  out = jax.vmap(lambda q: kernels.attention(q, q, q))(q)
  assert out.shape == q.shape


@pytest.mark.parametrize("bad,message", [
    (dict(v=jnp.ones((2, 16, 1, 8))), r"k \(2, 16, 2, 8\) and v \(2, 16, 1, 8\)"),
    (dict(k=jnp.ones((2, 16, 3, 8)), v=jnp.ones((2, 16, 3, 8))), "num_kv_heads 3 .* must divide num_heads 4"),
    (dict(k=jnp.ones((2, 16, 2, 8), jnp.bfloat16), v=jnp.ones((2, 16, 2, 8), jnp.bfloat16)), "share a dtype"),
    (dict(segment_ids=jnp.zeros((2, 15), jnp.int32)), r"segment_ids \(2, 15\) must be \[B, T\]"),
    (dict(segment_ids=jnp.zeros((2, 16))), "segment_ids must be integers"),
    (dict(kv_seq_lengths=jnp.ones((3,), jnp.int32)), r"kv_seq_lengths \(3,\) must be \[B\]"),
    (dict(local_window=-1), "local_window -1 must be an int >= 0"),
    (dict(implementation="flash"), "unknown attention implementation 'flash'"),
    (dict(q=jnp.ones((2, 8, 4, 8)), segment_ids=jnp.zeros((2, 8), jnp.int32)),
     "q_len 8 must equal kv_len 16"),
])
def test_bad_input_is_named(bad, message):
  args = dict(q=jnp.ones((2, 16, 4, 8)), k=jnp.ones((2, 16, 2, 8)), v=jnp.ones((2, 16, 2, 8)))
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    kernels.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
