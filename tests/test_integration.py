"""Cross-library integration: the pinned libraries work together, not just import.

Each test wires two or more of the pinned libraries through their public APIs
and checks a property that fails if their versions disagree.
"""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import qwix
import tensorstore as ts
import tokamax
from flax import nnx

from jax_ai_stack.absl_flags import tokamax_flags_parsed

pytestmark = pytest.mark.integration


class MLP(nnx.Module):

  def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(din, dhidden, rngs=rngs)
    self.out = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _regression_data(n: int = 64):
  x = jax.random.normal(jax.random.key(0), (n, 8))
  y = jnp.sin(x.sum(axis=1, keepdims=True))
  return x, y


def _train_step():
  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return step


def test_nnx_model_trained_with_optax_chain_lowers_loss():
  model = MLP(8, 32, 1, rngs=nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-4))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x, y = _regression_data()
  step = _train_step()
  losses = [float(step(model, optimizer, x, y)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]


def test_nnx_state_round_trips_through_orbax_bitwise(tmp_path):
  model = MLP(8, 16, 2, rngs=nnx.Rngs(1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  x, y = _regression_data()
  _train_step()(model, optimizer, x, jnp.zeros((x.shape[0], 2)))
  state = nnx.state((model, optimizer))

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    fresh = nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))(
            MLP(8, 16, 2, rngs=nnx.Rngs(99))
        )
    )
    restored = checkpointer.restore(tmp_path / "ckpt", nnx.state(fresh))

  flat_saved = jax.tree.leaves(state)
  flat_restored = jax.tree.leaves(restored)
  assert len(flat_saved) == len(flat_restored)
  for a, b in zip(flat_saved, flat_restored):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grain_pipeline_feeds_nnx_and_its_state_restores_same_batches():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(256, 8)).astype(np.float32)
  records = [{"x": f, "y": np.sin(f.sum(keepdims=True))} for f in features]
  dataset = (
      grain.MapDataset.source(records).shuffle(seed=7).repeat().to_iter_dataset().batch(16)
  )
  model = MLP(8, 32, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  step = _train_step()

  iterator = iter(dataset)
  first = [float(step(model, optimizer, b["x"], b["y"])) for b in (next(iterator) for _ in range(20))]
  assert first[-1] < first[0]

  saved = iterator.get_state()
  expected = [next(iterator) for _ in range(3)]
  restored = iter(dataset)
  restored.set_state(saved)
  for want in expected:
    got = next(restored)
    np.testing.assert_array_equal(got["x"], want["x"])
    np.testing.assert_array_equal(got["y"], want["y"])


def test_qwix_ptq_int8_forward_under_jit_is_close_to_float():
  model = MLP(16, 64, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 16))
  reference = model(x)
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
  quantized = qwix.quantize_model(model, qwix.PtqProvider(rules), x)

  weight_dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(quantized, nnx.Param))}
  assert jnp.dtype(jnp.int8) in weight_dtypes

  output = nnx.jit(lambda m, x: m(x))(quantized, x)
  error = float(jnp.max(jnp.abs(output - reference)))
  scale = float(jnp.max(jnp.abs(reference)))
  assert 0 < error < 0.05 * scale  # int8 changes the result, but only a little.


def _reference_attention(q, k, v, causal):
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if causal:
    t, s = q.shape[1], k.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("causal", [False, True])
def test_tokamax_attention_matches_softmax_reference_on_cpu(causal):
  tokamax_flags_parsed()  # tokamax 0.0.12 otherwise parses pytest's argv.
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 32, 4, 16))
  k = jax.random.normal(keys[1], (2, 32, 2, 16))
  v = jax.random.normal(keys[2], (2, 32, 2, 16))
  out = tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  np.testing.assert_allclose(out, _reference_attention(q, k, v, causal), atol=2e-5, rtol=2e-5)


def test_tensorstore_writes_and_reads_an_array(tmp_path):
  data = np.arange(24, dtype=np.float32).reshape(4, 6)
  spec = {
      "driver": "zarr",
      "kvstore": {"driver": "file", "path": str(tmp_path / "array.zarr")},
  }
  store = ts.open(
      spec, create=True, dtype=ts.float32, shape=data.shape, chunk_layout=ts.ChunkLayout(chunk_shape=[2, 3])
  ).result()
  store.write(data).result()
  reopened = ts.open(spec).result()
  np.testing.assert_array_equal(reopened.read().result(), data)
  np.testing.assert_array_equal(reopened[1:3, 2:5].read().result(), data[1:3, 2:5])
