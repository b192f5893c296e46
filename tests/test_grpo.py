"""The GRPO-family objective: advantages per group, the clipped token loss, the KL estimate,
the three aggregations, and the loss on a model (ratio exactly 1, the policy gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.tasks import grpo, objectives

RNG = np.random.default_rng(0)
REWARDS = RNG.integers(0, 3, (5, 4)).astype(np.float32)


def test_advantages_compare_each_reward_with_its_group():
  mean = REWARDS.mean(axis=1, keepdims=True)
  np.testing.assert_allclose(grpo.advantages(REWARDS, "grpo"),
                             (REWARDS - mean) / (REWARDS.std(axis=1, ddof=1, keepdims=True)
                                                 + 1e-4),
                             rtol=1e-6)
  np.testing.assert_allclose(grpo.advantages(REWARDS, "dr_grpo"), REWARDS - mean, atol=1e-6)
  others = np.array([[np.delete(row, g).mean() for g in range(4)] for row in REWARDS])
  np.testing.assert_allclose(grpo.advantages(REWARDS, "rloo"), REWARDS - others, atol=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_rewards_has_no_advantage(kind):
  assert not grpo.advantages(np.full((2, 4), 3.0), kind).any()


def test_the_token_loss_is_clipped_where_the_ratio_leaves_its_range():
  logps = jnp.log(jnp.array([[1.0, 1.5, 0.5, 1.1]]) * 0.1)
  old = jnp.log(jnp.full((1, 4), 0.1))
  for advantage, expected_loss, expected_clipped in [
      (1.0, [-1.0, -1.3, -0.5, -1.1], [False, True, False, False]),
      (-1.0, [1.0, 1.5, 0.8, 1.1], [False, False, True, False])]:
    losses, clipped = grpo.token_losses(logps, old, jnp.array([advantage]), epsilon=0.2,
                                        epsilon_high=0.3)
    np.testing.assert_allclose(losses[0], expected_loss, rtol=1e-5)
    assert clipped[0].tolist() == expected_clipped


def test_the_kl_estimate_is_zero_at_the_reference_and_positive_away_from_it():
  logps = jnp.array([-1.0, -2.0, -0.5])
  assert not grpo.kl_to_reference(logps, logps).any()
  away = grpo.kl_to_reference(logps, logps + jnp.array([0.3, -0.4, 1.0]))
  d = np.array([0.3, -0.4, 1.0])
  np.testing.assert_allclose(away, np.exp(d) - d - 1, rtol=1e-5)


def test_the_aggregations_weigh_rows_and_tokens_as_their_papers_do():
  losses = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
  assert float(grpo.aggregate(losses, mask, "sequence", 4)) == pytest.approx((2.0 + 4.0) / 2)
  assert float(grpo.aggregate(losses, mask, "token", 4)) == pytest.approx(10.0 / 4)
  assert float(grpo.aggregate(losses, mask, "constant", 4)) == pytest.approx(10.0 / 8)


def _batch(model, rows: int = 4, length: int = 12):
  """A fresh rollout batch whose `sampler_logps` are the model's own (an engine that agrees
  with the trainer)."""
  tokens = RNG.integers(0, model.config.vocab_size, (rows, length + 1)).astype(np.int32)
  mask = np.zeros((rows, length), np.float32)
  mask[:, 5:] = 1.0
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
           "segment_ids": jnp.ones((rows, length), jnp.int32),
           "positions": jnp.tile(jnp.arange(length), (rows, 1)), "loss_mask": jnp.asarray(mask),
           "advantages": jnp.asarray(RNG.normal(size=rows).astype(np.float32)),
           "fresh": jnp.ones((rows,))}
  batch["sampler_logps"] = objectives.target_logps(
      model, batch["inputs"], batch["targets"], segment_ids=batch["segment_ids"],
      positions=batch["positions"])
  return batch


@pytest.mark.slow
def test_the_loss_on_a_model_is_the_policy_gradient_of_its_advantages():
  """At one update per rollout the ratio is exactly 1: the loss is minus the advantage, and
  its gradient is that of -A log pi summed the same way."""
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  batch = _batch(model)
  objective = grpo.GroupRelative(aggregation="sequence")
  loss, metrics = objective.loss(model, batch)
  assert float(loss) == pytest.approx(-float(batch["advantages"].mean()), rel=1e-5)
  assert float(metrics["clip_fraction"]) == 0.0
  logps = objectives.target_logps(model, batch["inputs"], batch["targets"],
                                  segment_ids=batch["segment_ids"], positions=batch["positions"])
  completion = np.asarray(logps)[:, 5:]  # _batch's loss mask.
  assert float(metrics["entropy"]) == pytest.approx(-completion.mean(), rel=1e-5)

  def reinforce(model):
    logps = objectives.target_logps(model, batch["inputs"], batch["targets"],
                                    segment_ids=batch["segment_ids"],
                                    positions=batch["positions"])
    return grpo.aggregate(-logps * batch["advantages"][:, None], batch["loss_mask"],
                          "sequence", 8)

  ours = nnx.grad(lambda m: objective.loss(m, batch)[0])(model)
  expected = nnx.grad(reinforce)(model)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_a_kl_penalty_needs_the_reference_and_is_zero_against_the_policy_itself():
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  batch = _batch(model)
  assert not grpo.GroupRelative().needs_reference
  penalised = grpo.GroupRelative(beta=0.5)
  assert penalised.needs_reference
  loss, metrics = penalised.loss(model, batch, reference=model)
  assert float(metrics["kl"]) == 0.0
  assert float(loss) == pytest.approx(float(grpo.GroupRelative().loss(model, batch)[0]))
  with pytest.raises(Exception, match="needs a reference model"):
    objectives.training_loss(penalised)(model, batch)


def test_a_run_on_prompts_trains_the_objective_its_rl_section_asks():
  config = config_lib.load("lm-tiny-grpo", overrides=[
      "rl.loss_aggregation=token", "rl.epsilon_high=0.28", "rl.beta=0.04"])
  objective = grpo.for_config(config)
  assert (objective.aggregation, objective.epsilon, objective.epsilon_high, objective.beta,
          objective.max_completion_tokens) == ("token", 0.2, 0.28, 0.04, 16)


def test_later_updates_on_a_rollout_compare_with_the_sampling_policy_and_clip():
  """Rows not fresh take the engine's log-probabilities as pi_old: a policy that moved far
  from them is clipped (positive advantages, ratio above 1 + epsilon_high)."""
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  batch = _batch(model)
  logps = objectives.target_logps(model, batch["inputs"], batch["targets"],
                                  segment_ids=batch["segment_ids"], positions=batch["positions"])
  later = {**batch, "fresh": jnp.zeros((4,)), "advantages": jnp.ones((4,)),
           "sampler_logps": logps - 1.0}  # The policy is e times likelier than the sampler.
  loss, metrics = grpo.GroupRelative(epsilon_high=0.3).loss(model, later)
  assert float(metrics["clip_fraction"]) == 1.0
  assert float(loss) == pytest.approx(-1.3, rel=1e-5)
  assert float(metrics["sampler_logp_gap"]) == 0.0  # Measured at the first update only.


def test_truncated_importance_sampling_weighs_a_first_update_by_the_capped_ratio():
  """An engine whose log-probabilities are below the trainer's (a kernel's arithmetic) makes
  the first update's tokens weigh pi / pi_engine, at most the cap; where they agree the loss
  is exactly the uncorrected one."""
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  batch = _batch(model)
  logps = batch["sampler_logps"]
  weights = grpo.importance_weights(logps, logps - jnp.float32([[0.1], [0.1], [5.0], [0.0]]),
                                    jnp.float32([1, 1, 1, 0]), 3.0)
  expected = np.float32([[np.exp(0.1)], [np.exp(0.1)], [3.0], [1.0]]) * np.ones(logps.shape)
  np.testing.assert_allclose(weights, expected, rtol=1e-5)
  agreeing = {**batch, "sampler_logps": logps}
  corrected, uncorrected = grpo.GroupRelative(), grpo.GroupRelative(importance_cap=None)
  assert float(corrected.loss(model, agreeing)[0]) == float(uncorrected.loss(model, agreeing)[0])
  apart = {**batch, "sampler_logps": logps - 0.1, "advantages": jnp.ones((4,))}
  assert float(corrected.loss(model, apart)[0]) == pytest.approx(-np.exp(0.1), rel=1e-5)
  assert float(uncorrected.loss(model, apart)[0]) == pytest.approx(-1.0, rel=1e-5)
