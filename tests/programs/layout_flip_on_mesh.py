"""On 8 devices (JAX fixes the count at start): checkpoints restored in the other layer layout.

argv: the folder for the checkpoints."""

import dataclasses
import json
import sys

import grain
import jax
from flax import nnx

from jax_ai_stack.recipes import checkpoint, sharding
from jax_ai_stack.recipes.models import layer_stack
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.sharding_config import MeshConfig

mesh_config = MeshConfig(rules="fsdp_tp", data=1, fsdp=4, tensor=2)
mesh, rules = sharding.build_mesh(mesh_config), sharding.logical_rules(mesh_config)
config = DecoderConfig(vocab_size=64, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2,
                       mlp_dim=64, max_seq_len=32, attention_impl="xla")
out = {}
for scan in (False, True):
  saved = nnx.state(Decoder(dataclasses.replace(config, scan_layers=scan), rngs=nnx.Rngs(0)))
  directory = sys.argv[1] + f"/{scan}"
  with checkpoint.build_manager(directory, checkpoint.CheckpointConfig()) as manager:
    checkpoint.save(manager, 1, saved, iter(grain.MapDataset.range(2).to_iter_dataset()),
                    {}, force=True)
  abstract = nnx.state(nnx.eval_shape(
      lambda: Decoder(dataclasses.replace(config, scan_layers=not scan), rngs=nnx.Rngs(0))))
  shardings = sharding.state_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(), read_only=True)
  restored = checkpoint.restore(manager, abstract)
  manager.close()
  placed = all(x.sharding == s for x, s in zip(jax.tree.leaves(restored.state),
                                                jax.tree.leaves(shardings)))
  back, _ = layer_stack.match_layout(nnx.to_pure_dict(restored.state), nnx.to_pure_dict(saved))
  out[str(scan)] = {"placed": placed, "converted": restored.converted,
                    "bitwise": checkpoint.tree_equal(back, nnx.to_pure_dict(saved))}
print(json.dumps(out))
