"""On 8 devices (JAX fixes the count at start): each attention kernel sharded against one device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jax_ai_stack import kernels
from jax_ai_stack.recipes import sharding

mesh = sharding.build_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
attention_sharding = kernels.AttentionSharding(mesh, batch=("data", "fsdp"), heads=("tensor",))
keys = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(keys[0], (4, 32, 4, 8))
k, v = (jax.random.normal(key, (4, 32, 2, 8)) for key in keys[1:3])
cotangent = jax.random.normal(keys[3], q.shape)
segment_ids = jnp.asarray(np.repeat([[0, 1, 2, 2]], 4, 0).repeat(8, 1), jnp.int32)


sinks = 2.0 * jax.random.normal(jax.random.key(1), (4,))  # GPT-OSS's: split with the heads.


def forward_and_grads(name, sharding):
  name, with_sinks = name.removesuffix("+sinks"), name.endswith("+sinks")

  def run(q, k, v, segment_ids):
    def f(q, k, v):
      return kernels.attention(q, k, v, segment_ids=segment_ids, implementation=name,
                               sharding=sharding, sinks=sinks if with_sinks else None)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cotangent))
  return jax.jit(run)


def sub_jaxprs(params):  # jax.core.jaxprs_in_params is gone in jax 0.12.
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)  # A ClosedJaxpr holds a Jaxpr.
      if hasattr(inner, "eqns"):
        yield inner


def pallas_operand_shapes(jaxpr):
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      shapes.append(list(eqn.invars[0].aval.shape))
    for sub in sub_jaxprs(eqn.params):
      shapes += pallas_operand_shapes(sub)
  return shapes


spec = attention_sharding.qkv_spec(batch=4)
placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
ids = jax.device_put(segment_ids, NamedSharding(mesh, jax.sharding.PartitionSpec(spec[0])))
out = {}
for name in ("xla", "tokamax_xla", "pallas_gpu", "xla_blocked", "xla_blocked+sinks"):
  single = forward_and_grads(name, None)(q, k, v, segment_ids)
  sharded = forward_and_grads(name, attention_sharding)(*placed, ids)
  jaxpr = jax.make_jaxpr(forward_and_grads(name, attention_sharding))(*placed, ids).jaxpr
  out[name] = {
      "errors": [float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
                 for a, b in zip(sharded, single)],
      "out_spec": list(sharded[0].sharding.spec),
      "shard_map": "shard_map" in str(jaxpr),
      "pallas_q_shapes": pallas_operand_shapes(jaxpr),
  }
print(json.dumps(out))
