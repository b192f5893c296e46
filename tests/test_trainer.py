"""`trainer`: the progress line and the run's last line show each objective's headline
metrics beside the loss (a GRPO run's loss hovers near 0 whatever it learns)."""

from __future__ import annotations

import types

from jax_ai_stack.recipes.tasks import base, grpo, objectives
from jax_ai_stack.recipes.trainer import progress_text


def test_grpo_shows_its_reward_and_each_part_but_not_the_spread():
  step = {"loss": 0.0, "reward": 0.625, "reward_std": 0.2, "reward_exact_answer": 0.5,
          "reward_answer_format": 0.75, "clip_fraction": 0.0, "entropy": 1.3}
  assert grpo.GroupRelative().headline(step) == {
      "reward": 0.625, "reward_exact_answer": 0.5, "reward_answer_format": 0.75}
  assert grpo.GroupRelative().headline({"loss": 0.0}) == {}  # A later update on the rollout.


def test_dpo_shows_its_preference_accuracy_and_next_token_nothing_more():
  step = {"loss": 0.69, "preference_accuracy": 0.75, "reward_margin": 0.1, "logp_chosen": -9.0}
  assert objectives.DirectPreference().headline(step) == {"preference_accuracy": 0.75,
                                                          "reward_margin": 0.1}
  assert objectives.NextToken().headline(step) == {}


def test_a_task_without_an_objective_shows_the_loss_alone():
  task = types.SimpleNamespace(objective=None)
  assert base.Task.headline(task, {"loss": 1.0, "reward": 2.0}) == {}


def test_the_progress_line_carries_the_headline_between_loss_and_throughput():
  text = progress_text({"loss": 0.0001, "throughput": 5210.2, "reward": 0.5},
                       {"reward": 0.5, "reward_exact_answer": 0.25}, "tokens")
  assert text == "loss 0.000, reward 0.500, reward_exact_answer 0.250  5,210 tokens/s"
