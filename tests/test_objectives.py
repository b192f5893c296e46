"""Objectives: the next token, and DPO against the base (adapters off, or a frozen copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes.finetune import adapters, reference
from jax_ai_stack.recipes.tasks import objectives
from jax_ai_stack.recipes.tasks.lm import LanguageModel

RNG = np.random.default_rng(0)
LOGPS = [RNG.normal(-20, 5, 16).astype(np.float32) for _ in range(4)]


def _numpy_dpo(pc, pr, rc, rr, beta, kind, eps):
  """The DPO, cDPO and IPO losses as their papers write them, in float64 NumPy."""
  margin = (pc.astype(np.float64) - rc) - (pr - rr)
  log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
  if kind == "ipo":
    return np.mean((margin - 1 / (2 * beta)) ** 2), margin
  return np.mean(-(1 - eps) * log_sigmoid(beta * margin) - eps * log_sigmoid(-beta * margin)), margin


@pytest.mark.parametrize("beta,kind,eps", [(0.1, "sigmoid", 0.0), (0.5, "sigmoid", 0.2),
                                           (0.1, "ipo", 0.0)])
def test_the_dpo_loss_equals_numpy_on_fixed_log_probs(beta, kind, eps):
  loss, metrics = objectives.dpo_loss(*map(jnp.asarray, LOGPS), beta=beta, kind=kind,
                                      label_smoothing=eps)
  expected, margin = _numpy_dpo(*LOGPS, beta, kind, eps)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["reward_margin"]), beta * margin.mean(), rtol=1e-5)
  assert float(metrics["preference_accuracy"]) == np.mean(margin > 0)
  np.testing.assert_allclose(float(metrics["reward_chosen"]),
                             beta * np.mean(LOGPS[0] - LOGPS[2]), rtol=1e-5)


TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=16",
        "finetune.base=runs/base", "finetune.lora={rank: 4}"]


def _pair_batch():
  tokens = RNG.integers(0, 256, (2, 2, 16)).astype(np.int32)
  mask = np.zeros((2, 16), np.float32)
  mask[:, 6:12] = 1
  batch = {}
  for s, side in enumerate(objectives.SIDES):
    batch.update({f"{side}_inputs": tokens[s], f"{side}_targets": np.roll(tokens[s], -1, 1),
                  f"{side}_segment_ids": np.ones((2, 16), np.int32),
                  f"{side}_positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
                  f"{side}_loss_mask": mask})
  return batch


def test_the_reference_is_the_base_bitwise_with_trained_adapters():
  config = config_lib.load("lm-tiny", overrides=TINY)
  task = LanguageModel(config)
  base = task.build_model(0)
  adapted = adapters.add_adapters(task.build_model(0), config.finetune.lora, config.model, 2)
  graphdef, state = nnx.split(adapted)
  trained = jax.tree_util.tree_map_with_path(  # Adapters that moved: B no longer zero.
      lambda path, x: x + 0.5 if "lora" in jax.tree_util.keystr(path) else x, state)
  adapted = nnx.merge(graphdef, trained)
  batch = _pair_batch()
  reference = objectives.sequence_logps(adapters.adapters_off(adapted), batch)
  theirs = objectives.sequence_logps(base, batch)
  policy = objectives.sequence_logps(adapted, batch)
  for ours, base_logps, moved in zip(reference, theirs, policy):
    assert (np.asarray(ours) == np.asarray(base_logps)).all()  # Bitwise.
    assert not np.allclose(moved, base_logps)  # The adapters do change the policy.


def test_sequence_log_probs_sum_the_masked_tokens_of_each_side():
  config = config_lib.load("lm-tiny", overrides=TINY)
  model = LanguageModel(config).build_model(0)
  batch = _pair_batch()
  chosen, _ = objectives.sequence_logps(model, batch)
  logits = model(batch["chosen_inputs"], segment_ids=batch["chosen_segment_ids"],
                 positions=batch["chosen_positions"])
  logps = jax.nn.log_softmax(logits.astype(jnp.float32))
  picked = np.take_along_axis(np.asarray(logps), batch["chosen_targets"][..., None], -1)[..., 0]
  np.testing.assert_allclose(chosen, (picked * batch["chosen_loss_mask"]).sum(-1), rtol=1e-5)


def test_the_frozen_copy_is_the_base_bitwise_after_the_weights_moved():
  config = config_lib.load("lm-tiny", overrides=TINY[:-1])
  task = LanguageModel(config)
  base = task.build_model(0)
  model = reference.add_frozen_copy(task.build_model(0))
  graphdef, state = nnx.split(model)
  moved = jax.tree_util.tree_map_with_path(  # Every parameter trained; the copy is not one.
      lambda path, x: x if jax.tree_util.keystr(path).startswith("['reference']") else x + 0.01,
      state)
  model = nnx.merge(graphdef, moved)
  batch = _pair_batch()
  frozen = objectives.sequence_logps(reference.frozen_copy_model(model), batch)
  for ours, theirs, policy in zip(frozen, objectives.sequence_logps(base, batch),
                                  objectives.sequence_logps(model, batch)):
    assert (np.asarray(ours) == np.asarray(theirs)).all()  # Bitwise.
    assert not np.allclose(policy, theirs)
  bare = reference.without_frozen_copy(model)
  assert not nnx.state(bare, reference.Frozen) and nnx.state(model, reference.Frozen)
  np.testing.assert_array_equal(bare(batch["chosen_inputs"]), model(batch["chosen_inputs"]))


def test_the_objective_follows_the_data():
  plain = config_lib.load("lm-tiny")
  assert objectives.for_config(plain) == objectives.NextToken()
  dpo_config = config_lib.load("lm-tiny-dpo")
  dpo = LanguageModel(dpo_config).objective
  assert dpo == objectives.DirectPreference(beta=0.1) and dpo.needs_reference
  model = LanguageModel(dpo_config).build_model(0)
  with pytest.raises(config_lib.ConfigError, match="this run keeps none: set finetune.base"):
    objectives.training_loss(dpo, lambda m: None)(model, _pair_batch())
  with pytest.raises(UsageError, match="NextToken reads tokens data and this "
                                                  "recipe's data.source='preference_stdlib' gives"):
    LanguageModel(dpo_config, objective=objectives.NextToken())


def test_preference_data_needs_a_base():
  with pytest.raises(config_lib.ConfigError, match="data.source='preference_stdlib' trains DPO, "
                                                   "whose reference model is the base"):
    config_lib.load("lm-tiny-dpo", overrides=["finetune.base=null", "finetune.lora=null"])


class _ScaledNextToken(objectives.NextToken):
  """A new objective of one's own: the next token's loss, scaled, with a metric of its own."""

  def loss(self, model, batch, reference=None):
    loss, metrics = super().loss(model, batch, reference)
    return 3.0 * loss, {**metrics, "unscaled": loss}


@pytest.mark.slow
def test_a_run_is_built_with_the_objective_its_task_is_given(tmp_path):
  from jax_ai_stack.recipes import train

  config = config_lib.load("lm-tiny", overrides=[
      *TINY[:-2], "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
      "train.sample_tokens=0", "train.progress=false", "data.batch_size=2",
      "data.max_documents=20"])
  train.run(config, tmp_path, task=lambda c: LanguageModel(c, objective=_ScaledNextToken()))
  record = [r for r in train.read_metrics(tmp_path) if r["split"] == "eval"][-1]
  assert record["eval_loss"] == pytest.approx(3 * record["eval_unscaled"], rel=1e-6)
  assert record["eval_perplexity"] > 0  # NextToken's evaluation, inherited.
  assert isinstance(LanguageModel(config).objective, objectives.NextToken)


def test_the_image_family_learns_by_the_classification_objective():
  from jax_ai_stack.recipes import tasks

  task = tasks.for_config(config_lib.load("digits-cnn"))
  assert isinstance(task.objective, objectives.Classification)
  model = task.build_model(0)
  model.eval()  # No dropout: the two calls below see the same logits.
  images = jnp.asarray(RNG.normal(size=(4, *task.config.model.image_shape)), jnp.float32)
  labels = jnp.array([0, 1, 2, 3])
  loss, metrics = task.loss(model, {"images": images, "labels": labels})
  logits = np.asarray(model(images), np.float64)
  expected = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(4), labels])
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert float(metrics["accuracy"]) == np.mean(logits.argmax(-1) == np.asarray(labels))


def test_dpo_on_a_mixture_of_experts_adds_the_router_losses():
  """As next-token training does: the loss is DPO's plus the router's, and the metrics
  hold the DPO loss alone (`dpo_loss`) beside the router's."""
  config = config_lib.load("moe-tiny", overrides=[*TINY[:-2], "model.moe.num_experts=4",
                                                  "model.moe.router_z_loss_coef=0.001"])
  model = LanguageModel(config).build_model(0)
  objective = objectives.DirectPreference(beta=0.1, kind="sigmoid", label_smoothing=0.0)
  # Policy = reference (a copy): only the policy's pass hands up its router losses.
  loss, metrics = objectives.training_loss(objective, nnx.clone)(model, _pair_batch())
  router = 0.01 * metrics["router_aux_loss"] + 0.001 * metrics["router_z_loss"]
  assert float(metrics["dpo_loss"]) == pytest.approx(np.log(2), rel=1e-6)
  assert float(router) > 0 and float(loss) == pytest.approx(np.log(2) + float(router), rel=1e-6)
  assert "expert_share_3" in metrics


@pytest.mark.parametrize("preset", ["lm-tiny", "lm-tiny-sft", "lm-tiny-dpo"])
def test_a_task_s_batch_spec_is_its_first_batch_s_fields(preset):
  """What `train --dry-run --topology` compiles a step for is what the data pipeline feeds
  it: every field, shape and dtype (a run on prompts: tests/test_rl_rollout.py)."""
  from jax_ai_stack.recipes import config as config_lib
  from jax_ai_stack.recipes import tasks

  recipe = config_lib.load(preset, overrides=["data.max_documents=60", "data.seq_len=128",
                                              "data.batch_size=2"])
  task = tasks.for_config(recipe)
  first = next(iter(task.dataset("train", 0)))
  assert {k: (v.shape, v.dtype) for k, v in first.items()} == {
      k: (s.shape, s.dtype) for k, s in task.batch_spec(2).items()}
