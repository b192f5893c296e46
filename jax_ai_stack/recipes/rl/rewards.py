"""Rewards are plain Python: `f(prompts, completions, **columns) -> list[float]`.

`rl.rewards` names them as 'module:function' (imported from the current
directory or PYTHONPATH, as `model.task` is), `rl.reward_weights` weighs them.
A reward gets every completion of a rollout batch at once: `prompts` (each
row's prompt as the data gives it: text, or a list of messages),
`completions` (the text sampled, without its end-of-turn token) and each
other column of the prompt data (`answer`, ...) as a list of the same length;
it returns one number per completion. A reward that raises, or returns the
wrong number of values, or one that is not a finite number, stops the run
with one line naming it (`RewardError`); the rollout happens before the
update, so nothing is lost.

`exact_answer` and `answer_format` are the rewards of the built-in prompts
(`data.source: prompts_arithmetic`, `prompts_reversal`): the completion's last
word is the `answer` column; the whole completion matches the `pattern` column.

Example:
  >>> rewards = load(("jax_ai_stack.recipes.rl.rewards:exact_answer",), (1.0,))
  >>> score(rewards, ["?", "?"], ["7 + 5 = 12", "12 - 3 = 8"], {"answer": ["12", "9"]}).tolist()
  [[1.0], [0.0]]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jax_ai_stack.errors import ConfigError, UserError
from jax_ai_stack.recipes import configlib

_WORD = re.compile(r"-?\w+")


class RewardError(UserError):
  """A reward function that failed or answered wrongly; the message names it."""


@dataclasses.dataclass(frozen=True)
class Reward:
  """One reward function, its 'module:function' name and its weight."""

  name: str
  function: Callable[..., Sequence[float]]
  weight: float

  @property
  def short_name(self) -> str:
    """The function's name, for metrics (`reward_<short_name>`)."""
    return self.name.rpartition(":")[2].rpartition(".")[2]


def load(refs: Sequence[str], weights: Sequence[float]) -> list[Reward]:
  """The reward functions `refs` names; ConfigError for one that does not import."""
  rewards = []
  for ref, weight in zip(refs, weights):
    function = configlib.import_named(ref, "rl.rewards")
    if not callable(function):
      raise ConfigError(f"rl.rewards: {ref!r} is a {type(function).__name__}, not a function")
    rewards.append(Reward(ref, function, float(weight)))
  return rewards


def score(rewards: Sequence[Reward], prompts: list, completions: list[str],
          columns: Mapping[str, list]) -> np.ndarray:
  """Each reward of each completion, [N, len(rewards)] float32 (see the module)."""
  scores = np.zeros((len(completions), len(rewards)), np.float32)
  for r, reward in enumerate(rewards):
    try:
      values = list(reward.function(prompts, completions, **columns))
    except Exception as e:  # pylint: disable=broad-except
      raise RewardError(f"rl.rewards: {reward.name} raised {type(e).__name__}: {e}") from e
    if len(values) != len(completions):
      raise RewardError(f"rl.rewards: {reward.name} returned {len(values)} values for "
                        f"{len(completions)} completions")
    for i, value in enumerate(values):
      if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
          math.isfinite(value)):
        raise RewardError(f"rl.rewards: {reward.name} returned {value!r} for completion {i}: "
                          "a reward is a finite number")
    scores[:, r] = values
  return scores


def exact_answer(prompts: list, completions: list[str], answer: list[str],
                 **columns) -> list[float]:
  """1.0 where the completion's last word (letters, digits; a leading minus kept) is the
  `answer` column, else 0.0."""
  del prompts, columns
  found = [_WORD.findall(text) for text in completions]
  return [float(bool(words) and words[-1] == want) for words, want in zip(found, answer)]


def answer_format(prompts: list, completions: list[str], pattern: list[str],
                  **columns) -> list[float]:
  """1.0 where the whole completion matches its row's `pattern` column (a regular
  expression: "A + B = C" for arithmetic, "word -> drow" for reversal), else 0.0."""
  del prompts, columns
  return [float(re.fullmatch(want, text.strip()) is not None)
          for text, want in zip(completions, pattern)]
