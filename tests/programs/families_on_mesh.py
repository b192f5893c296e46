"""On 8 devices (JAX fixes the count at start): each family's checkpoint against one device.

argv: the families (JSON), the folder of their reference checkpoints."""

import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.sharding_config import MeshConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multidevice import grads_difference, load_on_mesh, logits_and_grads  # noqa: E402

names, references = json.loads(sys.argv[1]), sys.argv[2]
meshes = {"fsdp": MeshConfig(rules="fsdp", data=2, fsdp=4),
          "fsdp_tp": MeshConfig(rules="fsdp_tp", data=2, fsdp=2, tensor=2)}


def queries(model):
  """The first attention layer's query projection (latent attention's q_b_proj; Qwen3-Next's
  first layers are gated DeltaNet, which has none)."""
  return next(p for layer in model.layers for p in (getattr(layer.attention, "q_proj", None),
                                                     getattr(layer.attention, "q_b_proj", None))
              if p is not None)


out = {}
for index, name in enumerate(names):
  directory = references + "/" + name
  tokens = jnp.asarray(np.load(directory + "/reference.npz")["tokens"])
  tokens = jnp.concatenate([tokens] * 4)  # Rows for the data and fsdp axes.
  one_logits, one_grads = logits_and_grads(hf.load_model(directory), tokens)
  for mesh_name, mesh_config in list(meshes.items())[0 if index == 0 else 1:]:
    model = load_on_mesh(directory, mesh_config)
    logits, grads = logits_and_grads(model, tokens)
    out[name + " " + mesh_name] = {
        "logits": float(jnp.abs(logits - one_logits).max()),
        "grads": grads_difference(grads, one_grads),
        "q_proj": list(queries(model).kernel.get_value().sharding.spec),
        "devices": len(logits.sharding.device_set)}
print(json.dumps(out))
