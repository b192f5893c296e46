"""Attention under a mesh: XLA kernels partitioned by XLA, opaque ones per shard.

On 8 simulated CPU devices (data 2 x fsdp 2 x tensor 2), the sharded call must
give the single-device result, forward and gradients. Tolerance: max |sharded -
single| / max(1, max |single|) <= 5e-6 in float32 (~40 ulps). Attention sums
over keys and head features only, never across batch rows or heads, so no sum
crosses a device: the Pallas kernel, run per shard, is bitwise equal; XLA's
kernels, partitioned by XLA, fuse the smaller per-device shapes differently and
move the last bits (up to ~5e-7 seen).
"""

from __future__ import annotations

import jax
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels.sharded import AttentionSharding, AttentionShardingError

from multidevice import run_on_devices

TOLERANCE = 5e-6


@pytest.mark.cpu_backend
def test_sharded_attention_equals_one_device_and_opaque_kernels_run_per_shard():
  results = run_on_devices("sharded_attention")
  for name, result in results.items():
    assert max(result["errors"]) <= TOLERANCE, (name, result["errors"])
  # XLA's own kernels are left to XLA's partitioner: no shard_map is traced.
  assert not results["xla"]["shard_map"] and not results["tokamax_xla"]["shard_map"]
  assert results["xla"]["pallas_q_shapes"] == []
  # The Pallas kernel runs in a shard_map, on 1 of 4 rows and 2 of 4 query heads
  # (forward and backward kernels alike), and its output stays split that way.
  pallas = results["pallas_gpu"]
  assert pallas["shard_map"]
  assert pallas["pallas_q_shapes"] and all(s[:3] == [1, 32, 2] for s in pallas["pallas_q_shapes"]), (
      pallas["pallas_q_shapes"])
  assert pallas["out_spec"] == [["data", "fsdp"], None, "tensor", None]
  # The blocked kernel's loop over (row, head) slices is not XLA-partitionable: per shard too,
  # with attention sinks split as the heads are (each device's 2 heads, their 2 sinks).
  for name in ("xla_blocked", "xla_blocked+sinks"):
    assert results[name]["shard_map"]
    assert results[name]["out_spec"] == [["data", "fsdp"], None, "tensor", None]


def _inputs(num_kv_heads=2):
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (2, 16, 4, 8))
  k, v = (jax.random.normal(key, (2, 16, num_kv_heads, 8)) for key in keys[1:])
  return q, k, v


def test_heads_that_do_not_divide_by_the_tensor_axis_are_named():
  """MQA (one K/V head) cannot be split 2 ways: a named error, not a wrong GQA mapping."""
  mesh = jax.sharding.AbstractMesh((1, 1, 2), ("data", "fsdp", "tensor"))
  sharding = AttentionSharding(mesh, batch=("data", "fsdp"), heads=("tensor",))
  q, k, v = _inputs(num_kv_heads=1)
  with pytest.raises(AttentionShardingError, match=r"pallas_gpu .* num_heads 4 and num_kv_heads 1 "
                                                   r"must both divide by the 2 devices of mesh axes tensor"):
    jax.eval_shape(lambda q, k, v: kernels.attention(q, k, v, implementation="pallas_gpu",
                                                     sharding=sharding), q, k, v)
  # XLA splits what it can itself: the same call with the XLA kernel is fine.
  jax.eval_shape(lambda q, k, v: kernels.attention(q, k, v, implementation="xla",
                                                   sharding=sharding), q, k, v)


def test_sharding_on_one_device_traces_the_unsharded_program():
  mesh = jax.sharding.AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"))
  sharding = AttentionSharding(mesh, batch=("data", "fsdp"), heads=("tensor",))
  q, k, v = _inputs()
  program = lambda s: str(jax.make_jaxpr(
      lambda q, k, v: kernels.attention(q, k, v, implementation="pallas_gpu", sharding=s))(q, k, v))
  assert program(sharding) == program(None)
  assert "shard_map" not in program(sharding)


def test_bad_sharding_axes_are_refused():
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"))
  with pytest.raises(ValueError, match="mesh axis 'model' is not one of"):
    AttentionSharding(mesh, heads=("model",))
  with pytest.raises(ValueError, match=r"\['data'\] cannot split both batch and heads"):
    AttentionSharding(mesh, batch=("data",), heads=("data",))


def test_a_batch_that_does_not_divide_is_replicated():
  """One prompt decoded on a data-parallel mesh: every device runs the whole batch."""
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "tensor"))
  sharding = AttentionSharding(mesh, batch=("data",), heads=("tensor",))
  assert sharding.qkv_spec(batch=8) == jax.sharding.PartitionSpec("data", None, "tensor", None)
  assert sharding.qkv_spec(batch=1) == jax.sharding.PartitionSpec(None, None, "tensor", None)
