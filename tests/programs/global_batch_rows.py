"""On 8 devices (JAX fixes the count at start): each process's rows made one global batch."""

import json

import numpy as np

from jax_ai_stack.recipes import sharding

mesh_config = sharding.MeshConfig(data=2, fsdp=4)
mesh = sharding.build_mesh(mesh_config)
local = {"inputs": np.arange(8 * 3).reshape(8, 3)}
shardings = sharding.batch_shardings({"inputs": ("batch", "length")}, {"inputs": (8, 3)},
                                     mesh, sharding.logical_rules(mesh_config))
batch = sharding.global_batch(local, shardings, 8)
print(json.dumps({"spec": list(batch["inputs"].sharding.spec),
                  "shards": len(batch["inputs"].addressable_shards),
                  "rows": np.asarray(batch["inputs"]).tolist()}))
