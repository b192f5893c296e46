"""Rewards: 'module:function' imported, scored all at once, and each way a reward can fail
named in one line; the arithmetic task's two rewards."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes.data import arithmetic, reversal
from jax_ai_stack.recipes.rl import rewards


def length(prompts, completions, **columns):
  del prompts, columns
  return [float(len(text)) for text in completions]


def distinct_characters(prompts, completions, **columns):
  """A reward that varies within a group of an untrained model (test_rl_train)."""
  del prompts, columns
  return [float(len(set(text))) for text in completions]


def needs_answer(prompts, completions, answer):
  return [float(a == c) for a, c in zip(answer, completions)]


def broken(prompts, completions, **columns):
  raise KeyError("score")


def too_few(prompts, completions, **columns):
  return [1.0]


def not_a_number(prompts, completions, **columns):
  return [math.nan] * len(completions)


def a_bool(prompts, completions, **columns):
  return [True] * len(completions)


def test_rewards_score_every_completion_with_the_data_s_columns():
  loaded = rewards.load([f"{__name__}:length", f"{__name__}:needs_answer"], [1.0, 2.0])
  assert [r.short_name for r in loaded] == ["length", "needs_answer"]
  assert [r.weight for r in loaded] == [1.0, 2.0]
  scores = rewards.score(loaded, ["p", "q"], ["ab", "c"], {"answer": ["x", "c"]})
  np.testing.assert_array_equal(scores, [[2.0, 0.0], [1.0, 1.0]])


@pytest.mark.parametrize("name,message", [
    ("broken", r"test_rl_rewards:broken raised KeyError: 'score'"),
    ("too_few", "too_few returned 1 values for 2 completions"),
    ("not_a_number", "not_a_number returned nan for completion 0: a reward is a finite number"),
    ("a_bool", "a_bool returned True for completion 0"),
])
def test_a_reward_that_fails_is_named(name, message):
  loaded = rewards.load([f"{__name__}:{name}"], [1.0])
  with pytest.raises(rewards.RewardError, match=message):
    rewards.score(loaded, ["p", "q"], ["a", "b"], {})


def test_a_reward_that_does_not_import_is_a_config_error():
  with pytest.raises(ConfigError, match=r"rl.rewards=.no_such_module:f. does not import"):
    rewards.load(["no_such_module:f"], [1.0])
  with pytest.raises(ConfigError, match="is a float, not a function"):
    rewards.load(["math:pi"], [1.0])


def test_the_arithmetic_rewards_check_the_answer_and_the_format():
  completions = ["12 + 30 = 42", "the answer is 42", "12 + 30 = 41", "42 = 12 + 30 ",
                 "3 - 25 = -22"]
  answers = ["42"] * 4 + ["-22"]
  patterns = [arithmetic.PATTERN] * 5
  assert rewards.exact_answer([], completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
  assert rewards.answer_format([], completions, pattern=patterns) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_the_reversal_rewards_check_the_last_word_and_the_format():
  completions = ["evq -> qve", "qve", "evq -> qev", "evq->qve", "evq -> qve."]
  answers, patterns = ["qve"] * 5, [reversal.PATTERN] * 5
  assert rewards.exact_answer([], completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0]
  assert rewards.answer_format([], completions, pattern=patterns) == [1.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("overrides,message", [
    (["rl.rewards=[]", "rl.reward_weights=null"], "rl.rewards is empty: a run on prompts"),
    (["rl.rewards=[nocolon]"], "'nocolon' is not 'module:function'"),
    (["rl.reward_weights=[1.0]"], "rl.reward_weights has 1 weights for 2 rl.rewards"),
    (["rl.num_generations=1"], "rl.num_generations must be >= 2"),
    (["rl.epsilon_high=0.1"], r"rl.epsilon_high \(0.1\) must be >= rl.epsilon"),
    (["rl.importance_cap=0.5"], r"rl.importance_cap must be >= 1 \(or null"),
    (["rl.beta=0.1", "finetune.base=null"], "rl.beta=0.1 penalises the distance"),
])
def test_bad_rl_settings_name_the_field(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.load("lm-tiny-grpo", overrides=overrides)
