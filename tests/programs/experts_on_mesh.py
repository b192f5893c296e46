"""On 8 devices (JAX fixes the count at start): a MoE checkpoint, experts split, against one device.

argv: the reference checkpoint's folder."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.sharding_config import MeshConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multidevice import (grads_difference, load_on_mesh, logits_and_grads,  # noqa: E402
                         next_token_loss)


def sparse(model):
  """The first MoE layer (DeepSeek's first layers are dense)."""
  return next(layer for layer, moe in zip(model.layers, model.config.moe_layers) if moe)


def differences(model, tokens, one):
  logits, grads = logits_and_grads(model, tokens)
  return {"logits": float(jnp.abs(logits - one[0]).max()),
          "grads": grads_difference(grads, one[1])}


meshes = {"data 2 x expert 4": MeshConfig(data=2, expert=4),
          "fsdp 2 x expert 2 x tensor 2": MeshConfig(rules="fsdp_tp", data=1, fsdp=2,
                                                     expert=2, tensor=2)}
out = {}
directory = sys.argv[1]
tokens = jnp.asarray(np.load(directory + "/reference.npz")["tokens"])
tokens = jnp.concatenate([tokens] * 8)
one = hf.load_model(directory)
expected = {rows: logits_and_grads(one, tokens[:rows]) for rows in (len(tokens), 1)}
for mesh_name, mesh_config in meshes.items():
  model = load_on_mesh(directory, mesh_config)
  program = str(jax.make_jaxpr(lambda m, t: next_token_loss(m, t)[0])(model, tokens))
  out[mesh_name] = {
      "batch": differences(model, tokens, expected[len(tokens)]),
      "one row": differences(model, tokens[:1], expected[1]),
      "experts": str(sparse(model).mlp.down_proj.get_value().sharding.spec[0]),
      "exchange": all(p in program for p in ("shard_map", "all_gather", "reduce_scatter"))}
print(json.dumps(out))
