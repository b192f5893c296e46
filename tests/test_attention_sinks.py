"""Attention sinks and YaRN RoPE, each against a NumPy reference of its formula, apart from
any family: the training attention (causal, sliding window, packed segments, a decoding
step's key lengths, grouped queries) and the engine's paged attention with a sink logit per
head in each softmax's denominator; the kernels without sinks refused by the plan, with the
reason; and YaRN's frequencies and attention factor (GPT-OSS's)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels import paged
from jax_ai_stack.recipes.models.configs import RopeScaling
from jax_ai_stack.recipes.models.rope import rope_tables

RNG = np.random.default_rng(0)
B, T, N, K, H = 2, 9, 4, 2, 8


def _reference(q, k, v, sinks, *, window=None, segment_ids=None, lengths=None, causal=True):
  """float64 NumPy: softmax over [the seen keys' scaled logits, the head's sink], the sink's
  weight dropped."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  s, groups = k.shape[1], n // k.shape[2]
  out = np.zeros_like(q)
  for row in range(b):
    for head in range(n):
      logits = q[row, :, head] @ k[row, :, head // groups].T / math.sqrt(h)  # [T, S]
      i, j = np.arange(t)[:, None], np.arange(s)[None, :]
      seen = np.ones((t, s), bool)
      if causal:
        seen &= j <= i
      if window is not None:
        seen &= j >= i - window
      if segment_ids is not None:
        seen &= segment_ids[row][:, None] == segment_ids[row][None, :]
      if lengths is not None:
        seen &= j < lengths[row]
      both = np.concatenate([np.where(seen, logits, -np.inf),
                             np.full((t, 1), float(sinks[head]))], axis=1)
      weights = np.exp(both - both.max(axis=1, keepdims=True))
      weights /= weights.sum(axis=1, keepdims=True)
      out[row, :, head] = weights[:, :-1] @ v[row, :, head // groups]
  return out


def _qkv(t=T, s=None):
  s = s or t
  q = RNG.normal(size=(B, t, N, H)).astype(np.float32)
  k, v = RNG.normal(size=(2, B, s, K, H)).astype(np.float32)
  sinks = (2.0 * RNG.normal(size=N)).astype(np.float32)
  return q, k, v, sinks


@pytest.mark.parametrize("masks", ["causal", "window", "segments", "lengths"])
def test_attention_with_sinks_equals_numpy(masks):
  q, k, v, sinks = _qkv()
  segment_ids = np.array([[1] * 4 + [2] * 5, [1] * 9], np.int32)
  lengths = np.array([5, 9], np.int32)
  kwargs = {"causal": dict(), "window": dict(local_window=3),
            "segments": dict(segment_ids=jnp.asarray(segment_ids)),
            "lengths": dict(causal=False, kv_seq_lengths=jnp.asarray(lengths))}[masks]
  out = kernels.attention(*map(jnp.asarray, (q, k, v)), sinks=jnp.asarray(sinks), **kwargs)
  expected = _reference(q, k, v, sinks, window=kwargs.get("local_window"),
                        segment_ids=segment_ids if masks == "segments" else None,
                        lengths=lengths if masks == "lengths" else None,
                        causal=masks != "lengths")
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6, rtol=0)


def _gradients_equal_xla_s(implementation, t, masks, *, atol):
  """Asserts `implementation`'s gradients of q, k, v and the sinks (a weighted sum of its
  output, length `t`) equal the plain XLA softmax's; returns the inputs."""
  q, k, v, sinks = map(jnp.asarray, _qkv(t=t))
  weights = jnp.asarray(RNG.normal(size=q.shape), jnp.float32)

  def loss(name):
    return lambda *x: (kernels.attention(*x[:3], sinks=x[3], implementation=name,
                                         **masks) * weights).sum()

  for ours, theirs in zip(*(jax.grad(loss(name), argnums=range(4))(q, k, v, sinks)
                            for name in (implementation, "xla"))):
    np.testing.assert_allclose(ours, theirs, atol=atol)
  return q, k, v, sinks


@pytest.mark.parametrize("masks", [dict(), dict(local_window=3)])
def test_the_blocked_kernel_s_sinks_and_gradients_equal_xla_s(masks):
  """xla_blocked (CPU's first kernel) takes the sinks: its output and the gradients of q, k,
  v and the sinks equal the plain XLA softmax's, whose sinks the NumPy test above checks."""
  q, k, v, sinks = _gradients_equal_xla_s("xla_blocked", 13, masks, atol=2e-5)
  np.testing.assert_allclose(
      kernels.attention(q, k, v, sinks=sinks, implementation="xla_blocked", **masks),
      kernels.attention(q, k, v, sinks=sinks, implementation="xla", **masks), atol=2e-6)


@pytest.mark.parametrize("masks", [dict(), dict(local_window=31)])
def test_the_tpu_splash_kernel_s_sinks_and_gradients_equal_xla_s(masks):
  """JAX's TPU splash kernel takes the sinks (interpreted on this CPU; its tiles need 128
  positions): GPT-OSS on a TPU runs it, not a fallback. Output and the gradients of q, k, v
  and the sinks equal the plain XLA softmax's."""
  q, k, _, _ = _gradients_equal_xla_s("pallas_tpu_splash", 128, masks, atol=5e-5)
  plan = kernels.resolve_plan("pallas_tpu_splash", environ={})
  request = kernels.Request.from_shapes(q.shape, k.shape, q.dtype, sinks=True)
  assert plan.select(request, backend=kernels.Backend("tpu", "TPU v5 lite")).name == (
      "pallas_tpu_splash")


def test_sinks_have_gradients_and_large_negative_sinks_are_plain_attention():
  q, k, v, sinks = map(jnp.asarray, _qkv())
  grad = jax.grad(lambda s: kernels.attention(q, k, v, sinks=s).sum())(sinks)
  assert grad.shape == (N,) and bool(jnp.all(grad != 0)) and bool(jnp.all(jnp.isfinite(grad)))
  np.testing.assert_allclose(
      np.asarray(kernels.attention(q, k, v, sinks=jnp.full((N,), -1e9))),
      np.asarray(kernels.attention(q, k, v, implementation="xla")), atol=1e-6)


def test_kernels_without_sinks_are_refused_with_the_reason():
  q, k, v, sinks = map(jnp.asarray, _qkv())
  with pytest.raises(kernels.NoImplementationError, match="attention sinks not supported"):
    kernels.attention(q, k, v, sinks=sinks, implementation="tokamax_xla")
  plan = kernels.resolve_plan("auto", environ={})  # tokamax_xla before xla: passed over.
  request = kernels.Request.from_shapes(q.shape, k.shape, q.dtype, sinks=True)
  choice = plan.select(request)
  assert choice.name == "xla" and "sinks" in request.describe()
  long = kernels.Request.from_shapes((1, 512, N, H), (1, 512, K, H), q.dtype, sinks=True)
  assert plan.select(long).name == "xla_blocked"  # From T 256, CPU's first, and it takes them.
  assert kernels.Request.from_dict(request.to_dict()) == request
  with pytest.raises(ValueError, match=r"sinks \(3,\) must be \[N\] = \(4,\)"):
    kernels.attention(q, k, v, sinks=sinks[:3])


@pytest.mark.parametrize("window", [None, 2])
def test_paged_attention_with_sinks_equals_numpy(window):
  """A chunk of 3 queries per row at given positions over pages of 4 (rows at different
  lengths, grouped queries): the dense reference of each row's keys up to its positions."""
  page, width, t = 4, 3, 3
  tables = (1 + RNG.permutation(B * width)).reshape(B, width).astype(np.int32)
  pool = RNG.normal(size=(2, K, 1 + B * width, page, H)).astype(np.float32)
  dense = np.moveaxis(pool[:, :, tables], 1, -2).reshape(2, B, width * page, K, H)
  positions = np.array([[4, 5, 6], [9, 10, 11]], np.int32)
  q = RNG.normal(size=(B, t, N, H)).astype(np.float32)
  sinks = (2.0 * RNG.normal(size=N)).astype(np.float32)
  out = paged.paged_attention(jnp.asarray(q), jnp.asarray(pool[0]), jnp.asarray(pool[1]),
                              jnp.asarray(tables), jnp.asarray(positions), scale=H ** -0.5,
                              local_window=window, sinks=jnp.asarray(sinks))
  for row in range(B):  # Query i of the chunk sits at positions[row, i]: pad the keys' view.
    start = positions[row, 0]
    keys, values = dense[0, row:row + 1, :start + t], dense[1, row:row + 1, :start + t]
    padded = np.zeros((1, start + t, N, H), np.float32)
    padded[:, start:] = q[row:row + 1]
    expected = _reference(padded, keys, values, sinks, window=window)[:, start:]
    np.testing.assert_allclose(np.asarray(out[row:row + 1]), expected, atol=2e-6, rtol=0)


def test_the_paged_kernels_without_sinks_are_refused_for_xla_with_the_reason():
  name, why = paged.choose_paged_attention("auto", "tpu", "TPU v5 lite", sinks=True)
  assert name == "xla" and why.startswith("pallas_tpu refused: attention sinks not supported")
  name, why = paged.choose_paged_attention("pallas_gpu", "gpu", "H100", sinks=True)
  assert name == "xla" and "pallas_gpu refused" in why
  assert paged.choose_paged_attention("auto", "cpu", sinks=True)[0] == "xla"
  tpu = kernels.AttentionPlan(("xla",), "a test", backend=kernels.Backend("tpu", "TPU v5 lite"))
  assert tpu.paged_attention(sinks=True)[0] == "xla"
  assert tpu.paged_attention()[0] == "pallas_tpu"


def _yarn_numpy(head_dim, theta, factor, beta_fast, beta_slow, original, truncate):
  """transformers' `_compute_yarn_parameters`, written again in float64 NumPy."""
  def dimension(rotations):
    return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = dimension(beta_fast), dimension(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  high += 0.001 if low == high else 0
  ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
  base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  extrapolated = 1 - ramp
  inv_freq = base / factor * (1 - extrapolated) + base * extrapolated
  return inv_freq, 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_tables_equal_the_formula(truncate):
  """GPT-OSS's YaRN (factor 32, betas 32 and 1, 4096 original positions, theta 150000,
  head_dim 64): frequencies blended along the ramp, sin and cos times the attention factor."""
  scaling = RopeScaling(kind="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                        original_max_position_embeddings=4096, truncate=truncate)
  positions = jnp.asarray([[0, 1, 7, 300, 4000]])
  tables = rope_tables(positions, 64, 150_000.0, scaling)
  inv_freq, factor = _yarn_numpy(64, 150_000.0, 32.0, 32.0, 1.0, 4096, truncate)
  angles = np.asarray(positions, np.float64)[0, :, None] * inv_freq
  for table, wave in ((tables.cos, np.cos), (tables.sin, np.sin)):
    np.testing.assert_allclose(np.asarray(table)[0, :3, 0], factor * wave(angles[:3]),
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(table)[0, 3:, 0], factor * wave(angles[3:]),
                               atol=2e-3)  # float32 angles of positions 300 and 4000.
  assert 0 < np.sum((inv_freq < 1 / 150_000.0 ** (np.arange(0, 64, 2) / 64) - 1e-12)) < 32
  explicit = RopeScaling(kind="yarn", factor=32.0, attention_factor=1.5)
  assert float(rope_tables(positions, 64, 1e4, explicit).cos[0, 0, 0, 0]) == 1.5
