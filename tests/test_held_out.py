"""`held_out`: a run's eval metrics, and the iterator it closes on leaving."""

from __future__ import annotations


import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import held_out


class Closing:
  """An iterator over 0, 1, 2, ... that records whether it was closed."""

  def __init__(self):
    self.count, self.closed = 0, False

  def __iter__(self):
    return self

  def __next__(self):
    self.count += 1
    return self.count - 1

  def close(self):
    self.closed = True


def test_opened_closes_the_iterator_even_when_the_body_raises():
  iterator = Closing()
  with pytest.raises(RuntimeError):
    with held_out.opened(iterator) as it:
      next(it)
      raise RuntimeError("the body failed")
  assert iterator.closed and iterator.count == 1


def test_a_run_without_validation_says_evaluation_is_off():
  with pytest.raises(ConfigError, match=r"evaluation is off \(train.eval_every=0\)"):
    held_out.evaluate(None, eval_batches=2, measure=None, evaluation=None)


def test_the_means_stop_at_eval_batches_and_name_an_empty_split():
  seen = []

  def measure(batch):
    seen.append(batch)
    return {"loss": float(batch), "tokens": 4.0}

  def evaluate(validation):
    return held_out.evaluate(validation, eval_batches=2, measure=measure,
                             evaluation=lambda metrics: metrics)

  assert evaluate([1.0, 3.0, 100.0]) == {"eval_loss": 2.0}  # "tokens" is no metric.
  assert seen == [1.0, 3.0]
  with pytest.raises(ConfigError, match="the validation split has no full batch"):
    evaluate([])


def test_a_mixture_reports_each_component_and_their_mean():
  result = held_out.evaluate({"a": [1.0], "b": [3.0]}, eval_batches=1,
                             measure=lambda batch: {"loss": batch},
                             evaluation=lambda m: {**m, "eval_seen": 1.0})
  assert result == {"eval_loss": 2.0, "eval_seen": 1.0, "eval_a_loss": 1.0, "eval_b_loss": 3.0}


def test_a_run_on_prompts_is_measured_by_its_policys_rollouts():
  policies = []

  class Rollouts:
    def evaluate(self, model, batches, count):
      return {"eval_reward": float(sum(next(batches) for _ in range(count))), "model": model}

  result = held_out.evaluate([1.0, 2.0, 4.0], eval_batches=2, measure=None, evaluation=None,
                             rollouts=Rollouts(),
                             policy=lambda: policies.append(1) or "policy")
  assert result == {"eval_reward": 3.0, "model": "policy"} and policies == [1]


def test_held_out_no_longer_imports_the_run():
  """run.py calls held_out.evaluate: an import back would make the two a circle."""
  import inspect  # pylint: disable=g-import-not-at-top
  assert "recipes.run" not in inspect.getsource(held_out)
