"""On 8 devices (JAX fixes the count at start): a decoder with a layout against the plain one.

argv: the DecoderConfig's fields (JSON)."""

import json
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ai_stack.recipes import sharding
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.models.decoding import generate

config = DecoderConfig(**json.loads(sys.argv[1]))
placement = sharding.Placement.build(
    sharding.MeshConfig(data=2, fsdp=2, tensor=2, rules="fsdp_tp"), {})
plain = Decoder(config, rngs=nnx.Rngs(0))
laid_out = Decoder(config, rngs=nnx.Rngs(0), layout=placement.layout())
state = nnx.state(plain)
nnx.update(laid_out, jax.device_put(state, placement.state_shardings(state)))


def program(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)), state


def greedy(model):
  return generate(model, prompt, 4, temperature=0.0, rng=jax.random.key(0))


tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, config.vocab_size)
placed = jax.device_put(tokens, NamedSharding(placement.mesh, P(("data", "fsdp"))))
run, laid_out_state = program(laid_out)
plain_run, plain_state = program(plain)
one_run, one_state = program(sharding.on_one_device(laid_out, jax.devices()[0]))
prompt = tokens[:1, :3]
print(json.dumps({
    "error": float(np.max(np.abs(run(laid_out_state, placed) - plain_run(plain_state, tokens)))
                   / np.max(np.abs(plain_run(plain_state, tokens)))),
    "constraints": str(jax.make_jaxpr(run)(laid_out_state, placed)).count("sharding_constraint"),
    "plain_constraints": str(jax.make_jaxpr(plain_run)(plain_state, tokens)).count(
        "sharding_constraint"),
    "one_device_same": bool(np.array_equal(one_run(one_state, tokens),
                                           plain_run(plain_state, tokens))),
    "one_device_constraints": str(jax.make_jaxpr(one_run)(one_state, tokens)).count(
        "sharding_constraint"),
    "generated": np.asarray(greedy(laid_out)).tolist(),
    "expected": np.asarray(greedy(plain)).tolist(),
}))
