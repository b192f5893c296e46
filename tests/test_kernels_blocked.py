"""`xla_blocked`: the staircase attention matches the reference, bit-stable, and `auto` picks it.

Forward outputs and gradients (VJP with a random cotangent) are compared to
`test_kernels_attention.reference_attention` (float32 at HIGHEST precision),
under `jit`. Tolerance: max |actual - expected| / max(1, max |expected|) of
5e-5 in float32 and 4e-2 in bfloat16, as for every other kernel.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels import blocked, rules
from jax_ai_stack.kernels.request import Backend
from test_kernels_attention import TOLERANCE, reference_attention


def _inputs(batch, q_len, kv_len, heads, kv_heads, head_dim=8, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), dtype)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
  return q, k, v, cotangent


def _segments(batch, q_len):
  """Three packed documents of different lengths per row, 0 included."""
  cuts = np.array([q_len * 5 // 16, q_len * 11 // 16])
  row = np.searchsorted(cuts, np.arange(q_len), side="right")
  return jnp.asarray(np.stack([(row + i) % 3 for i in range(batch)]), jnp.int32)


def _forward_and_grads(f, q, k, v, cotangent):
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(cotangent.astype(out.dtype))


def _max_errors(actual, expected):
  return {
      label: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(e, np.float32)))
                   / max(1.0, float(np.max(np.abs(np.asarray(e, np.float32))))))
      for label, a, e in zip(("out", "dq", "dk", "dv"), actual, expected)
  }


CASES = {
    # name: (batch, q_len, kv_len, heads, kv_heads, causal, segment_ids, local_window)
    "causal": (2, 32, 32, 2, 2, True, False, None),
    "causal_gqa": (2, 32, 32, 4, 2, True, False, None),
    "causal_mqa_odd_length": (1, 37, 37, 3, 1, True, False, None),
    "packed_segments_gqa": (2, 32, 32, 4, 2, True, True, None),
    "local_window": (2, 32, 32, 4, 2, True, False, 5),
    "local_window_not_causal": (1, 32, 32, 2, 1, False, False, 3),
    "window_shorter_queries": (2, 16, 32, 4, 2, True, False, 4),
    "causal_longer_queries": (1, 32, 16, 2, 2, True, False, None),
    "bidirectional_segments": (2, 24, 24, 4, 1, False, True, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_float32(case):
  batch, q_len, kv_len, heads, kv_heads, causal, segment_ids, window = case
  q, k, v, cotangent = _inputs(batch, q_len, kv_len, heads, kv_heads)
  ids = _segments(batch, q_len) if segment_ids else None

  def run(block_size):
    return lambda q, k, v: blocked.blocked_attention(
        q, k, v, causal=causal, segment_ids=ids, local_window=window, block_size=block_size)

  reference = lambda q, k, v: reference_attention(
      q, k, v, causal=causal, segment_ids=ids, local_window=window)
  # Blocks of 7 leave a shorter last block; 64 is one block. One program for all three.
  *actuals, expected = jax.jit(lambda: [
      _forward_and_grads(f, q, k, v, cotangent) for f in (run(7), run(64), reference)])()
  for actual in actuals:
    errors = _max_errors((actual[0], *actual[1]), (expected[0], *expected[1]))
    assert max(errors.values()) <= TOLERANCE["float32"], errors
    assert actual[0].shape == q.shape and actual[0].dtype == q.dtype


def test_matches_reference_bfloat16_with_a_scale():
  q, k, v, cotangent = _inputs(2, 48, 48, 4, 2, head_dim=16, dtype=jnp.bfloat16)
  ids = _segments(2, 48)
  run = lambda q, k, v: kernels.attention(q, k, v, segment_ids=ids, scale=0.3,
                                          implementation="xla_blocked")
  actual = jax.jit(lambda: _forward_and_grads(run, q, k, v, cotangent))()
  # The reference scales by 1 / sqrt(H): rescaling q gives it the same logits.
  reference = lambda q, k, v: reference_attention(
      q * (0.3 * 16 ** 0.5), k, v, causal=True, segment_ids=ids)
  expected = _forward_and_grads(reference, q, k, v, cotangent)
  assert actual[0].dtype == jnp.bfloat16
  errors = _max_errors((actual[0], *actual[1]), (expected[0], *expected[1]))
  assert max(errors.values()) <= TOLERANCE["bfloat16"], errors


def test_a_query_that_sees_no_key_gets_zeros_and_finite_gradients():
  # Window 2 over 4 keys: queries 6.. see none of them (top-left aligned).
  q, k, v, cotangent = _inputs(1, 12, 4, 2, 1)
  run = lambda q, k, v: blocked.blocked_attention(q, k, v, causal=True, local_window=2,
                                                  block_size=4)
  out, grads = jax.jit(lambda: _forward_and_grads(run, q, k, v, cotangent))()
  assert np.all(np.asarray(out[:, 6:]) == 0)
  expected = reference_attention(q[:, :6], k, v, causal=True, local_window=2)
  np.testing.assert_allclose(out[:, :6], expected, atol=5e-5)
  assert all(np.all(np.isfinite(g)) for g in grads)


def test_same_inputs_give_the_same_bits_across_calls_and_compilations():
  q, k, v, cotangent = _inputs(2, 24, 24, 4, 2)
  ids = _segments(2, 24)

  def step(q, k, v):
    run = lambda q, k, v: blocked.blocked_attention(q, k, v, causal=True, segment_ids=ids,
                                                    block_size=8)
    return _forward_and_grads(run, q, k, v, cotangent)

  compiled = jax.jit(step)
  first, second = compiled(q, k, v), compiled(q, k, v)
  third = jax.jit(step)(q, k, v)  # A separate compilation.
  for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(third)):
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_default_block_size_keeps_the_number_of_blocks_bounded():
  assert blocked.default_block_size(16) == blocked.default_block_size(512) == 64
  assert blocked.default_block_size(4096) == 4096 // blocked.MAX_BLOCKS
  assert len(blocked._blocks(8192, 8192, blocked.default_block_size(8192), True, None)) == 16


def test_causal_blocks_see_only_keys_up_to_their_last_query():
  assert blocked._blocks(10, 10, 4, True, None) == ((0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 0, 10))
  assert blocked._blocks(10, 10, 4, False, 2) == ((0, 4, 0, 4), (4, 8, 2, 8), (8, 10, 6, 10))
  assert blocked._blocks(6, 6, 4, False, None) == ((0, 4, 0, 6), (4, 6, 0, 6))


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_a_bad_block_size_is_named(block_size):
  x = jnp.ones((1, 8, 1, 4))
  with pytest.raises(ValueError, match=f"block_size {block_size!r} must be a positive int"):
    blocked.blocked_attention(x, x, x, causal=True, block_size=block_size)


def _request(q_len, **masks):
  return kernels.Request.from_shapes((8, q_len, 4, 32), (8, q_len, 2, 32), "float32", **masks)


def test_auto_picks_it_on_cpu_for_causal_requests_from_the_measured_length():
  choice = kernels.select(_request(256, segment_ids=True))
  assert choice.name == "xla_blocked" and choice.deterministic
  assert choice.order == kernels.PREFERENCE["cpu"]
  assert [name for name, _ in choice.fallbacks][:2] == ["xla_blocked", "tokamax_xla"]
  windowed = kernels.select(_request(rules.BLOCKED_MIN_Q_LEN, causal=False, local_window=8))
  assert windowed.name == "xla_blocked"


@pytest.mark.parametrize("masks, reason", [
    (dict(q_len=rules.BLOCKED_MIN_Q_LEN - 1), f"q_len {rules.BLOCKED_MIN_Q_LEN - 1} < "),
    (dict(q_len=256, causal=False), "nothing to skip without causal or local_window"),
    (dict(q_len=256, kv_seq_lengths=True), "kv_seq_lengths not supported"),
])
def test_auto_passes_it_over_with_the_reason(masks, reason):
  choice = kernels.report(_request(**masks), backend=Backend("cpu"), probe=False)
  assert choice.name == "tokamax_xla"
  verdict = next(v for v in choice.verdicts if v.name == "xla_blocked")
  assert verdict.status == "rejected" and reason in verdict.reason
  assert re.search(rf"\n  xla_blocked +no +{re.escape(reason)}", choice.report())


def test_named_explicitly_it_runs_where_auto_passes_it_over():
  request = _request(16)
  assert kernels.select(request, "xla_blocked").name == "xla_blocked"
  q, k, v, _ = _inputs(2, 16, 16, 4, 2)
  out = kernels.attention(q, k, v, causal=False, implementation="xla_blocked")
  np.testing.assert_allclose(out, reference_attention(q, k, v, causal=False), atol=5e-5)


def test_auto_on_gpu_and_tpu_does_not_try_it():
  for platform in ("gpu", "tpu"):
    assert "xla_blocked" not in kernels.PREFERENCE[platform]
