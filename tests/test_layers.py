"""`models.layers`: the decoder's MLP on tokens, its norms, and a block's residual form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import eager_sharding_scope, layers, rope
from jax_ai_stack.recipes.models.configs import DecoderConfig

SIZES = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
             max_seq_len=16)
CONFIG = DecoderConfig(**SIZES)


def test_the_mlp_on_tokens_equals_the_mlp_on_each_row():
  with eager_sharding_scope():  # Outside a mesh the axis names stay metadata.
    mlp = layers.MLP(CONFIG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 32))
  each = jnp.stack([mlp(x[i:i + 1])[0] for i in range(2)])
  np.testing.assert_allclose(mlp(x), each, rtol=1e-5, atol=1e-6)


def test_an_offset_norm_starts_as_the_plain_norm():
  with eager_sharding_scope():
    plain = layers.rms_norm(CONFIG, nnx.Rngs(0))
    offset = layers.rms_norm(DecoderConfig(kind="gemma2", **SIZES), nnx.Rngs(0))  # Offset 1.
  assert isinstance(offset, layers.OffsetRMSNorm) and float(offset.scale[...].max()) == 0.0
  x = jax.random.normal(jax.random.key(2), (3, 32))
  np.testing.assert_allclose(offset(x), plain(x), rtol=1e-6)


def test_a_block_adds_to_its_input_and_keeps_its_shape():
  plan = kernels.resolve_plan(CONFIG.attention_impl, origin="test", environ={})
  with eager_sharding_scope():
    block = layers.Block(CONFIG, plan, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (2, 8, 32))
  tables = rope.rope_tables(jnp.arange(8)[None], CONFIG.resolved_head_dim, CONFIG.rope_theta)
  out, cache, stats = block(x, tables)
  assert out.shape == x.shape and cache is None and stats is None
  assert not np.allclose(out, x)
