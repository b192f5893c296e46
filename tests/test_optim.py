"""Optax chains from OptimConfig: every optimizer and schedule, the decay mask."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ai_stack.recipes import configlib, optim


class TinyLM(nnx.Module):
  """Embedding, a norm, a biased projection: one of each kind of parameter."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.final_norm = nnx.RMSNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 16, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.final_norm(self.embed(tokens)))


def _loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _train(config: optim.OptimConfig, steps: int = 40):
  model = TinyLM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optim.build(config, total_steps=steps), wrt=nnx.Param)
  tokens = jnp.tile(jnp.arange(16)[None], (4, 1))  # A learnable cycle 0, 1, ..., 15.

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)]


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd", "muon"])
def test_every_optimizer_lowers_the_loss(name):
  lr = {"sgd": 0.5, "adafactor": 0.3}.get(name, 0.02)
  losses = _train(optim.OptimConfig(name=name, learning_rate=lr, warmup_steps=2))
  assert losses[-1] < 0.7 * losses[0], (name, losses[0], losses[-1])


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_every_schedule_lowers_the_loss(schedule):
  losses = _train(optim.OptimConfig(learning_rate=0.02, schedule=schedule, warmup_steps=4))
  assert losses[-1] < 0.7 * losses[0]


def test_schedule_shapes():
  base = optim.OptimConfig(learning_rate=1.0, warmup_steps=10, final_lr_ratio=0.1)
  total = 100
  cosine = optim.build_schedule(base, total)
  assert float(cosine(0)) == 0.0
  assert float(cosine(10)) == pytest.approx(1.0)
  assert float(cosine(100)) == pytest.approx(0.1)
  wsd = optim.build_schedule(dataclasses.replace(base, schedule="wsd", wsd_decay_fraction=0.2), total)
  assert float(wsd(50)) == pytest.approx(1.0)  # Stable phase.
  assert float(wsd(79)) == pytest.approx(1.0)
  assert float(wsd(90)) == pytest.approx(0.55)  # Halfway down the linear decay.
  assert float(wsd(100)) == pytest.approx(0.1)
  linear = optim.build_schedule(dataclasses.replace(base, schedule="linear"), total)
  assert float(linear(55)) == pytest.approx(0.55)
  constant = optim.build_schedule(dataclasses.replace(base, schedule="constant"), total)
  assert float(constant(5)) == pytest.approx(0.5) and float(constant(99)) == 1.0


def test_restarts_warm_up_again_from_the_rate_reached():
  config = optim.OptimConfig(learning_rate=1.0, warmup_steps=10, final_lr_ratio=0.1,
                             schedule="wsd", wsd_decay_fraction=0.2, restarts=(100,))
  lr = optim.build_schedule(config, 200)
  alone = optim.build_schedule(dataclasses.replace(config, restarts=()), 100)
  # Up to the restart: the schedule of a run that ends there (its cooldown included).
  assert [float(lr(i)) for i in range(100)] == [float(alone(i)) for i in range(100)]
  reached = float(lr(99))
  assert reached < 0.2
  assert float(lr(100)) == pytest.approx(reached)  # The pit stop: warmup from there ...
  assert float(lr(105)) == pytest.approx((reached + 1.0) / 2)
  assert float(lr(150)) == pytest.approx(1.0)  # ... to the peak, stable, then decay again.
  assert float(lr(199)) < 0.2
  accumulated = optim.build_schedule(dataclasses.replace(config, accumulate_steps=2), 100)
  assert float(accumulated(49)) < 0.2 and float(accumulated(60)) == 1.0  # Step 100: update 50.


def test_decay_mask_skips_norms_biases_and_embeddings():
  model = TinyLM(nnx.Rngs(0))
  mask = optim.decay_mask(optim.OptimConfig())(nnx.state(model, nnx.Param))
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(mask)}
  decayed = {p for p, v in flat.items() if v}
  assert any(p.startswith("head/kernel") for p in decayed)
  assert not any(p.startswith(("embed", "final_norm", "head/bias")) for p in decayed), decayed


def test_weight_decay_moves_only_unmasked_parameters():
  """With zero gradients only weight decay acts: masked parameters stay put."""
  model = TinyLM(nnx.Rngs(0))
  config = optim.OptimConfig(learning_rate=0.1, warmup_steps=0, schedule="constant",
                             weight_decay=0.5, grad_clip_norm=None)
  optimizer = nnx.Optimizer(model, optim.build(config, total_steps=10), wrt=nnx.Param)
  before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
  zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  optimizer.update(model, zeros)
  after = nnx.state(model, nnx.Param)
  np.testing.assert_array_equal(after["embed"]["embedding"][...], before["embed"]["embedding"][...])
  np.testing.assert_array_equal(after["final_norm"]["scale"][...], before["final_norm"]["scale"][...])
  np.testing.assert_array_equal(after["head"]["bias"][...], before["head"]["bias"][...])
  assert not np.array_equal(after["head"]["kernel"][...], before["head"]["kernel"][...])


def test_gradient_accumulation_updates_every_k_steps():
  config = optim.OptimConfig(name="sgd", learning_rate=0.1, warmup_steps=0, schedule="constant",
                             weight_decay=0.0, accumulate_steps=2, grad_clip_norm=None, b1=0.0)
  tx = optim.build(config, total_steps=10)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  first, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
  second, state = tx.update({"w": jnp.full(3, 4.0)}, state, params)
  np.testing.assert_array_equal(first["w"], 0.0)
  np.testing.assert_allclose(second["w"], -0.1 * 3.0)  # The mean of both micro-batches.


def test_clipping_bounds_the_update():
  config = optim.OptimConfig(name="sgd", learning_rate=1.0, warmup_steps=0, schedule="constant",
                             weight_decay=0.0, grad_clip_norm=1.0, b1=0.0)
  tx = optim.build(config, total_steps=1)
  params = {"w": jnp.zeros(4)}
  updates, _ = tx.update({"w": jnp.full(4, 100.0)}, tx.init(params), params)
  assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("learning_rate", 0.0, "optim.learning_rate must be > 0"),
        ("name", "adam", "name"),
        ("accumulate_steps", 0, "optim.accumulate_steps"),
        ("no_decay", ["("], "not a regex"),
        ("restarts", [50, 50], r"optim.restarts\[1\]=50 must come after the restart before"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
  with pytest.raises(configlib.ConfigError, match=message):
    configlib.from_dict(optim.OptimConfig, {field: value}, source="optim")
