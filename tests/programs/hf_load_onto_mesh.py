"""On 8 devices (JAX fixes the count at start): a Hugging Face checkpoint loaded onto fsdp_tp.

argv: the checkpoint's folder."""

import json
import sys

import jax
import numpy as np
from flax import nnx

from jax_ai_stack.recipes import sharding
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

directory = sys.argv[1]
config = DecoderConfig(**hf.read_config(directory))
placement = sharding.Placement.build(
    sharding.MeshConfig(data=1, fsdp=4, tensor=2, rules="fsdp_tp"), {})
abstract = nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
shardings = placement.state_shardings(abstract)
target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)
params = hf.load_params(directory, config, target)
got = jax.tree.leaves(params)
wanted = jax.tree.leaves(shardings)
same = all(a.sharding == s for a, s in zip(got, wanted))
split = sum(not a.sharding.is_fully_replicated for a in got)
reference = hf.load_model(directory)
equal = all(np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(got, jax.tree.leaves(nnx.state(reference))))
q = params["layers"][0]["attention"]["q_proj"]["kernel"].get_value()
print(json.dumps({"same": same, "split": split, "equal": equal, "leaves": len(got),
                  "q_spec": list(q.sharding.spec)}))
