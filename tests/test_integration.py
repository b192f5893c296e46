"""Cross-library integration: the pinned libraries work together, not just import.

Each test wires two or more of the pinned libraries through their public APIs
and checks a property that fails if their versions disagree.
"""

from __future__ import annotations


import chex
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


@chex.dataclass
class _Batch:
  x: jax.Array
  y: jax.Array


def test_a_chex_dataclass_and_chex_assertions_run_under_jit():
  """Upstream's meta-package pins chex and its CI tests it: a pytree dataclass and the
  shape, type and tree assertions, inside a jitted NNX forward pass."""
  model = MLP(8, 16, 1, rngs=nnx.Rngs(0))

  @nnx.jit
  def predict(model, batch):
    chex.assert_shape(batch.x, (None, 8))
    chex.assert_type(batch.y, float)
    chex.assert_equal_shape_prefix([batch.x, batch.y], 1)
    return batch.replace(y=model(batch.x))

  x, y = _regression_data(16)
  batch = _Batch(x=x, y=y)
  assert len(jax.tree.leaves(batch)) == 2  # A pytree.
  predicted = predict(model, batch)
  chex.assert_trees_all_close(predicted.y, model(x), rtol=1e-6)
  chex.assert_tree_all_finite(predicted)
  with pytest.raises(AssertionError, match="shape"):  # Checked while tracing.
    predict(model, _Batch(x=jnp.ones((4, 3)), y=jnp.ones((4, 1))))


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


def test_orbax_export_serves_a_trained_recipe_model_as_it_computes(tmp_path):
  """orbax-export's JaxModule around a trained recipe model: the TF SavedModel it writes gives
  the model's own logits."""
  tf = pytest.importorskip("tensorflow", reason=(
      "orbax-export 0.0.8 imports tensorflow, which the tfds extra installs "
      "(pip install 'jax-ai-stack[tfds]'; CI installs it on every matrix row)"))
  from orbax.export import ExportManager, JaxModule, ServingConfig

  from jax_ai_stack.recipes import train
  from training_helpers import tiny_config

  train.run(tiny_config("train.steps=2", "train.eval_every=0", "train.sample_tokens=0"),
            tmp_path / "run")
  trainer = train.Trainer.open_finished(tmp_path / "run")
  try:
    model = trainer.inference_model()
  finally:
    trainer.close()
  graphdef, params = nnx.split(model)
  module = JaxModule(params, lambda params, tokens: nnx.merge(graphdef, params)(tokens))
  signature = [tf.TensorSpec((1, 8), tf.int32, name="tokens")]
  ExportManager(module, [ServingConfig("serving_default", input_signature=signature)]).save(
      str(tmp_path / "saved_model"))

  tokens = np.arange(8, dtype=np.int32)[None] + 3
  served = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"](
      tokens=tf.constant(tokens))
  (logits,) = served.values()
  np.testing.assert_allclose(logits.numpy(), np.asarray(model(tokens)), atol=1e-5, rtol=1e-5)


@pytest.mark.every_row  # About 10 s (tensorflow's import): the tfds extra is proven on each row.
def test_the_tfds_extra_reads_the_mnist_it_ships_offline_into_grain_and_nnx(tmp_path, monkeypatch):
  """tensorflow-datasets prepares the MNIST-shaped dataset its wheel ships for offline use
  (`tfds.testing.DummyMnist`: 28x28x1 PNG images, 10 classes, no download) as ArrayRecord;
  read back by path as a random-access source, it feeds a Grain pipeline and an NNX step."""
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")  # Read when tensorflow's C++ side loads.
  tf = pytest.importorskip("tensorflow", reason=(
      "tensorflow-datasets and the tensorflow it encodes images with come with the tfds "
      "extra (pip install 'jax-ai-stack[tfds]'; CI installs it on every matrix row)"))
  tfds = pytest.importorskip("tensorflow_datasets", reason=(
      "the tfds extra is not installed (pip install 'jax-ai-stack[tfds]')"))
  try:
    tf.config.set_visible_devices([], "GPU")  # The accelerator is JAX's, not tensorflow's.
  except RuntimeError:
    pass  # Already initialised by an earlier test in this process: too late, and harmless.

  builder = tfds.testing.DummyMnist(data_dir=str(tmp_path), file_format="array_record")
  tfds.disable_progress_bar()
  try:
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  finally:
    tfds.enable_progress_bar()
  assert not [path for path in (tmp_path / "downloads").rglob("*") if path.is_file()]

  source = tfds.builder_from_directory(builder.data_dir).as_data_source(split="train")
  assert len(source) == 20
  dataset = (grain.MapDataset.source(source).shuffle(seed=0)
             .map(lambda e: {"x": e["image"].reshape(-1).astype(np.float32) / 255.0,
                             "y": e["label"]})
             .batch(5, drop_remainder=True))
  batches = list(dataset)
  assert len(batches) == 4
  assert batches[0]["x"].shape == (5, 28 * 28) and batches[0]["y"].dtype == np.int64
  assert source[0]["image"].dtype == np.uint8  # The PNG it wrote, decoded: DummyMnist's ones.
  np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), np.float32(1 / 255))
  labels = np.concatenate([b["y"] for b in batches])
  np.testing.assert_array_equal(np.sort(labels), np.repeat(np.arange(10), 2))
  assert builder.info.features["label"].num_classes == 10
  np.testing.assert_array_equal(  # The same records as the source, in Grain's order.
      labels, [source[i]["label"] for i in grain.MapDataset.range(20).shuffle(seed=0)])

  model = MLP(28 * 28, 16, 10, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, b["x"], b["y"])) for b in batches]
  assert all(np.isfinite(losses))
