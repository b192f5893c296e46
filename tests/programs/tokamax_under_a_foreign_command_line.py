"""tokamax's attention under the host's flags: a fresh interpreter's argv is what absl reads.

argv: the host's flags (e.g. --model.num_layers 2 -q)."""

import jax.numpy as jnp

from jax_ai_stack.kernels import implementations

tokamax = implementations.import_tokamax()
x = jnp.ones((1, 8, 2, 8))
print(tokamax.dot_product_attention(x, x, x, implementation="xla").shape)
