"""On 8 devices (JAX fixes the count at start): each rule set's specs of parameters and moments."""

import json

import jax
import optax
from flax import nnx

from jax_ai_stack.recipes import sharding
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

SHOWN = ("q_proj/kernel/value", "up_proj/kernel/value", "embed/embedding/value")

config = DecoderConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                       vocab_size=256, max_seq_len=16)


def create():
  model = Decoder(config, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


state = nnx.state(nnx.eval_shape(create))
out = {}
for rules, sizes in [("dp", {}), ("fsdp", {"data": 2, "fsdp": 4}),
                     ("fsdp_tp", {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2})]:
  mesh_config = sharding.MeshConfig(rules=rules, **sizes)
  mesh = sharding.build_mesh(mesh_config)
  shardings = sharding.state_shardings(state, mesh, sharding.logical_rules(mesh_config))
  flat = {jax.tree_util.keystr(p, simple=True, separator="/"): list(s.spec)
          for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
  out[rules] = {k: v for k, v in flat.items() if k.endswith(SHOWN)}
print(json.dumps(out))
