"""On 8 devices (JAX fixes the count at start): the memory plan against the real arrays and XLA.

argv: the folder of the runs, the overrides (JSON), the meshes' overrides by name (JSON)."""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.recipes import memory, sharding, train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training_helpers import tiny_config  # noqa: E402


def shard_bytes(tree):
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


folder, overrides, meshes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
for name, mesh in meshes.items():
  config = tiny_config(*overrides, *mesh)
  trainer = train.Trainer.open(config, folder + "/" + name)
  trainer.close()
  placement = trainer.placement
  plan = memory.estimate_memory(config, placement.mesh)
  rows, seq_len = config.data.batch_size, config.data.seq_len
  shardings = sharding.batch_shardings(
      placement.batch_axes, {k: (rows, seq_len) for k in placement.batch_axes},
      placement.mesh, placement.rules)
  batch = {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=s)
           for k, s in shardings.items()}
  analysis = trainer.train_step.lower(trainer.state, batch).compile().memory_analysis()
  out[name] = {
      "real": [shard_bytes(trainer.state[0]), shard_bytes(trainer.state[1]),
               shard_bytes(nnx.state(trainer.model, nnx.Param))],
      "plan": [plan.parameters, plan.optimizer, plan.gradients],
      # A device count plans for an accelerator: without the lines of this host's CPU.
      "same_from_count": memory.estimate_memory(config, 8) == dataclasses.replace(
          plan, checkpoint_copy=0, float32_copies=0, runtime=0, sampling=0)
      and plan.checkpoint_copy > 0,
      "temp": analysis.temp_size_in_bytes,
      "estimate": plan.activations + plan.gradients + plan.gathered,
      "gathered": plan.gathered,
  }
print(json.dumps(out))
